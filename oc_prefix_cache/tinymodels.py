"""Tiny real GGUF models for the tests and the demo, made from the rig's source tree.

``test-llama-archs`` writes a random-weight model of a real architecture (2 layers,
n_embd 256) with a toy vocab. We keep its weights and graft on what a chat model needs:
the real Qwen tokenizer (151,936 tokens plus the Qwen3 added tokens), the Qwen3.5 chat
template and a 32k context. The result tokenizes and renders OpenCode prompts exactly as
a real Qwen model would, prefills 8k tokens in about a second on 2 cores, and weighs
~30 MB. Replies are random tokens, which is all the cache needs.

Models: ``qwen35`` (hybrid: gated delta-net + attention, the hard case) and ``qwen3``
(plain transformer), each with an ``-alt`` twin of the same shapes and other weights,
to prove that identity checks do not trust shapes.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RigError
from .files import file_lock
from .rig import Progress, Rig

N_VOCAB = 151_936
CONTEXT_LENGTH = 32_768
EOS_ID = 151_645  # <|im_end|>
PAD_ID = 151_643  # <|endoftext|>
TEMPLATE = "Qwen3.5-4B.jinja"

# The Qwen2.5/Qwen3 added tokens the vocab file leaves as [PADnnn]: (id, text, type)
# with type 3 = control, 4 = user-defined (as the HF converter marks them).
ADDED_TOKENS: tuple[tuple[int, str, int], ...] = tuple(
    (151_646 + i, text, 4 if text.startswith("<") and not text.startswith("<|") else 3)
    for i, text in enumerate([
        "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
        "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
        "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
        "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    ])
)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    seed: int


SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("qwen35", "qwen35", 42),
        ModelSpec("qwen35-alt", "qwen35", 4242),
        ModelSpec("qwen3", "qwen3", 42),
        ModelSpec("qwen3-alt", "qwen3", 4242),
    )
}


def model_path(rig: Rig, name: str) -> Path:
    if name not in SPECS:
        raise RigError(f"unknown tiny model {name!r}; choose one of {sorted(SPECS)}")
    return rig.models_dir / f"{name}.gguf"


def ensure_model(rig: Rig, name: str, *, progress: Progress | None = None) -> Path:
    """Return the cached model, generating it once if missing."""
    path = model_path(rig, name)
    if path.is_file():
        return path
    rig.models_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(rig.models_dir / ".lock"):
        if path.is_file():
            return path
        if progress:
            progress(f"generating tiny model {name}")
        _generate(rig, SPECS[name], path)
    return path


def _gguf(rig: Rig) -> Any:
    """Import gguf-py from the rig tree: it matches the server's GGUF reader exactly."""
    tree = str(rig.source_tree / "gguf-py")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    try:
        import gguf
    except ImportError as exc:
        raise RigError(
            f"gguf-py needs numpy, pyyaml and tqdm: pip install 'oc-prefix-cache[rig]' ({exc})"
        ) from exc
    return gguf


def _generate(rig: Rig, spec: ModelSpec, dest: Path) -> None:
    gguf = _gguf(rig)
    import numpy as np

    with tempfile.TemporaryDirectory(dir=rig.models_dir) as tmp:
        proc = subprocess.run(
            [str(rig.archs_tool), "-a", f"^{spec.arch}$", "-s", str(spec.seed), "-o", tmp],
            capture_output=True, text=True, timeout=300, check=False,
        )
        base_path = Path(tmp) / f"{spec.arch}-dense.gguf"
        if proc.returncode != 0 or not base_path.is_file():
            raise RigError(f"test-llama-archs failed for {spec.arch}: {proc.stderr[-2000:]}")
        base = gguf.GGUFReader(str(base_path))
        vocab = gguf.GGUFReader(str(rig.source_tree / "models" / "ggml-vocab-qwen35.gguf"))
        part = Path(tmp) / "out.gguf"
        writer = gguf.GGUFWriter(str(part), spec.arch)

        overridden = {"general.architecture", "general.name", f"{spec.arch}.context_length",
                      f"{spec.arch}.vocab_size"}
        for key, field in base.fields.items():
            if key.startswith(("GGUF.", "tokenizer.")) or key in overridden:
                continue
            _copy_field(gguf, writer, key, field)
        writer.add_uint32(f"{spec.arch}.context_length", CONTEXT_LENGTH)
        if f"{spec.arch}.vocab_size" in base.fields:
            writer.add_uint32(f"{spec.arch}.vocab_size", N_VOCAB)
        writer.add_string("general.name", f"ocpc-tiny-{spec.name}")

        tokens = list(vocab.fields["tokenizer.ggml.tokens"].contents())
        types = list(vocab.fields["tokenizer.ggml.token_type"].contents())
        for token_id, text, kind in ADDED_TOKENS:
            tokens[token_id], types[token_id] = text, kind
        writer.add_tokenizer_model(vocab.fields["tokenizer.ggml.model"].contents())
        writer.add_tokenizer_pre(vocab.fields["tokenizer.ggml.pre"].contents())
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(list(vocab.fields["tokenizer.ggml.merges"].contents()))
        writer.add_eos_token_id(EOS_ID)
        writer.add_pad_token_id(PAD_ID)
        writer.add_add_bos_token(False)
        writer.add_chat_template((rig.source_tree / "models" / "templates" / TEMPLATE).read_text())

        n_embd = None
        for tensor in base.tensors:
            if tensor.name in ("token_embd.weight", "output.weight"):
                n_embd = int(tensor.shape[0]) if tensor.name == "token_embd.weight" else n_embd
                continue  # rebuilt below for the real vocab; the head is tied to it
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        if n_embd is None:
            raise RigError(f"{spec.arch} test model has no token_embd.weight")
        rng = np.random.default_rng(spec.seed)
        embd = (rng.standard_normal((N_VOCAB, n_embd), dtype=np.float32) * 0.1).astype(np.float32)
        q4 = gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q4_0)
        writer.add_tensor("token_embd.weight", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        part.replace(dest)


def _copy_field(gguf: Any, writer: Any, key: str, field: Any) -> None:
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        values = list(field.contents())
        if values:  # gguf-py refuses empty arrays; the loader treats absent and empty alike
            writer.add_key_value(key, values, vtype, sub_type=field.types[-1])
    else:
        writer.add_key_value(key, field.contents(), vtype)
