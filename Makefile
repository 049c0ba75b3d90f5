# Two commands do all set-up on a fresh machine (README.md):
#   make demo   - build the CPU llama-server + tiny model once (cached), run the product on it
#   make test   - the whole test suite against the real server
# and one to package it:
#   make dist   - the sdist and the wheel in dist/ (the wheel carries the plugin and launcher)
.PHONY: demo test venv dist

venv:
	@test -x .venv/bin/python || python3 -m venv .venv
	@.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'

demo: venv
	.venv/bin/ocpc demo

test:
	bash tests/run.sh

dist: venv
	.venv/bin/python -m build --outdir dist .
