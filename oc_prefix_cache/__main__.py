from oc_prefix_cache.cli import app

app()
