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

``fat-kv`` is a plain transformer with a 27B model's KV footprint: 25 layers of 8 KV heads
x 128 dims in f16 make 102,400 bytes per token (a 27B's 8.6k-token head is ~880 MB on disk,
~100 KB per token), so an 8.6k-token slot file is ~880 MB and a 30k-token park ~3 GB. Its
other shapes stay tiny (n_embd 256), so what it costs beyond the tiny models is the KV
itself: attention over it, and the bytes of every save and restore. Not in ``SPECS`` (the
test suite does not need it): ``ensure_model(rig, "fat-kv")`` makes it on demand.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oc_prefix_cache.errors import RigError
from oc_prefix_cache.files import made_once
from oc_prefix_cache.rig.build import Progress, Rig

N_VOCAB = 151_936
CONTEXT_LENGTH = 32_768
EOS_ID = 151_645  # <|im_end|>
PAD_ID = 151_643  # <|endoftext|>
TEMPLATE = "Qwen3.5-4B.jinja"

# The Qwen2.5/Qwen3 added tokens the vocab file leaves as [PADnnn]: (id, text, type)
# with type 3 = control, 4 = user-defined (as the HF converter marks them).
ADDED_TOKENS: tuple[tuple[int, str, int], ...] = tuple(
    (151_646 + i, text, 4 if text.startswith("<") and not text.startswith("<|") else 3)
    for i, text in enumerate(
        [
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ]
    )
)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    seed: int


@dataclass(frozen=True)
class FatSpec:
    """A qwen3-architecture model written tensor by tensor, with its KV shape chosen."""

    name: str
    n_layer: int
    n_kv_head: int
    head_dim: int
    seed: int
    n_embd: int = 256
    n_ff: int = 512

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layer * self.n_kv_head * self.head_dim * 2  # K and V, f16


FAT = FatSpec("fat-kv", n_layer=25, n_kv_head=8, head_dim=128, seed=7)


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
    if name not in SPECS and name != FAT.name:
        raise RigError(f"unknown tiny model {name!r}; choose one of {sorted([*SPECS, FAT.name])}")
    return rig.models_dir / f"{name}.gguf"


def ensure_model(rig: Rig, name: str, *, progress: Progress | None = None) -> Path:
    """Return the cached model, generating it once if missing."""
    path = model_path(rig, name)

    def make() -> None:
        if progress:
            progress(f"generating tiny model {name}")
        if name == FAT.name:
            _generate_fat(rig, FAT, path)
        else:
            _generate(rig, SPECS[name], path)

    return made_once(path, make, lock=rig.models_dir / ".lock")


def _gguf(rig: Rig) -> Any:
    """Import gguf-py from the rig tree: it matches the server's GGUF reader exactly."""
    tree = str(rig.source_tree / "gguf-py")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    try:
        import gguf
    except ImportError as exc:
        raise RigError(f"gguf-py needs numpy, pyyaml and tqdm: pip install 'oc-prefix-cache[rig]' ({exc})") from exc
    return gguf


def _generate(rig: Rig, spec: ModelSpec, dest: Path) -> None:
    gguf = _gguf(rig)
    import numpy as np

    with tempfile.TemporaryDirectory(dir=rig.models_dir) as tmp:
        proc = subprocess.run(
            [str(rig.archs_tool), "-a", f"^{spec.arch}$", "-s", str(spec.seed), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        base_path = Path(tmp) / f"{spec.arch}-dense.gguf"
        if proc.returncode != 0 or not base_path.is_file():
            raise RigError(f"test-llama-archs failed for {spec.arch}: {proc.stderr[-2000:]}")
        base = gguf.GGUFReader(str(base_path))
        part = Path(tmp) / "out.gguf"
        writer = gguf.GGUFWriter(str(part), spec.arch)

        overridden = {"general.architecture", "general.name", f"{spec.arch}.context_length", f"{spec.arch}.vocab_size"}
        for key, field in base.fields.items():
            if key.startswith(("GGUF.", "tokenizer.")) or key in overridden:
                continue
            _copy_field(gguf, writer, key, field)
        writer.add_uint32(f"{spec.arch}.context_length", CONTEXT_LENGTH)
        if f"{spec.arch}.vocab_size" in base.fields:
            writer.add_uint32(f"{spec.arch}.vocab_size", N_VOCAB)
        writer.add_string("general.name", f"ocpc-tiny-{spec.name}")

        _add_chat_vocab(gguf, rig, writer)

        n_embd = None
        for tensor in base.tensors:
            if tensor.name in ("token_embd.weight", "output.weight"):
                n_embd = int(tensor.shape[0]) if tensor.name == "token_embd.weight" else n_embd
                continue  # rebuilt below for the real vocab; the head is tied to it
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        if n_embd is None:
            raise RigError(f"{spec.arch} test model has no token_embd.weight")
        _add_embeddings(gguf, writer, np.random.default_rng(spec.seed), n_embd)
        _finish(writer, part, dest)


def _generate_fat(rig: Rig, spec: FatSpec, dest: Path) -> None:
    """A qwen3 model from scratch: the KV shape ``spec`` asks for, random f16 weights scaled
    so activations stay finite (replies are random tokens either way)."""
    gguf = _gguf(rig)
    import numpy as np

    arch, rng = "qwen3", np.random.default_rng(spec.seed)
    q_dim = spec.n_kv_head * spec.head_dim  # as many query heads as KV heads: the least compute per KV byte
    with tempfile.TemporaryDirectory(dir=rig.models_dir) as tmp:
        part = Path(tmp) / "out.gguf"
        writer = gguf.GGUFWriter(str(part), arch)
        writer.add_string("general.name", f"ocpc-tiny-{spec.name}")
        for key, value in (
            ("context_length", CONTEXT_LENGTH),
            ("embedding_length", spec.n_embd),
            ("block_count", spec.n_layer),
            ("feed_forward_length", spec.n_ff),
            ("attention.head_count", spec.n_kv_head),
            ("attention.head_count_kv", spec.n_kv_head),
            ("attention.key_length", spec.head_dim),
            ("attention.value_length", spec.head_dim),
            ("vocab_size", N_VOCAB),
        ):
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        writer.add_float32(f"{arch}.rope.freq_base", 1_000_000.0)
        _add_chat_vocab(gguf, rig, writer)

        def weight(name: str, rows: int, cols: int) -> None:
            data = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)
            writer.add_tensor(name, data)

        def norm(name: str, n: int) -> None:
            writer.add_tensor(name, np.ones(n, dtype=np.float32))

        for i in range(spec.n_layer):
            blk = f"blk.{i}"
            norm(f"{blk}.attn_norm.weight", spec.n_embd)
            weight(f"{blk}.attn_q.weight", q_dim, spec.n_embd)
            weight(f"{blk}.attn_k.weight", q_dim, spec.n_embd)
            weight(f"{blk}.attn_v.weight", q_dim, spec.n_embd)
            norm(f"{blk}.attn_q_norm.weight", spec.head_dim)
            norm(f"{blk}.attn_k_norm.weight", spec.head_dim)
            weight(f"{blk}.attn_output.weight", spec.n_embd, q_dim)
            norm(f"{blk}.ffn_norm.weight", spec.n_embd)
            weight(f"{blk}.ffn_gate.weight", spec.n_ff, spec.n_embd)
            weight(f"{blk}.ffn_up.weight", spec.n_ff, spec.n_embd)
            weight(f"{blk}.ffn_down.weight", spec.n_embd, spec.n_ff)
        norm("output_norm.weight", spec.n_embd)
        _add_embeddings(gguf, writer, rng, spec.n_embd)
        _finish(writer, part, dest)


def _add_chat_vocab(gguf: Any, rig: Rig, writer: Any) -> None:
    """The real Qwen tokenizer, its added tokens and the Qwen3.5 chat template."""
    vocab = gguf.GGUFReader(str(rig.source_tree / "models" / "ggml-vocab-qwen35.gguf"))
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


def _add_embeddings(gguf: Any, writer: Any, rng: Any, n_embd: int) -> None:
    """Token embeddings for the real vocab (Q4_0; the output head is tied to them)."""
    import numpy as np

    embd = (rng.standard_normal((N_VOCAB, n_embd), dtype=np.float32) * 0.1).astype(np.float32)
    q4 = gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("token_embd.weight", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)


def _finish(writer: Any, part: Path, dest: Path) -> None:
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
