"""Seeded random checkpoints ("tiny models") made through transformers, plus a local tokenizer.

``models/tiny_configs.py`` registers a builder per architecture: ``register_tiny("qwen3_next",
builder)`` where ``builder(size: str, **overrides) -> (hf_config, hf_model_class)``; the class is
a transformers ``*ForCausalLM`` (or ``AutoModelForCausalLM``). ``make_tiny_checkpoint`` seeds
torch, instantiates it in fp32, saves it with ``save_pretrained`` and writes a byte-level BPE
tokenizer (any text round-trips) with ChatML special tokens and chat template.

Sizes: ``tiny`` (tests), ``small`` (end-to-end benchmark), ``mid`` (model benchmark); see
``size_dims``. CLI: ``python -m mambaradix.models.tiny --arch qwen3_next --out DIR``.

``mtp=True`` adds an architecture's multi-token-prediction head in its published layout
(``register_tiny(..., mtp=writer)``: seeded random ``mtp.*`` tensors and the config fields that
declare the head); the rest of the checkpoint is the same as without it.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SIZES = ("tiny", "small", "mid")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TinyBuilder = Callable[..., tuple[Any, Any]]
# (hf_config, the checkpoint's tensors, generator) -> (mtp.* tensors, config.json fields)
MtpWriter = Callable[[Any, dict, Any], tuple[dict, dict]]
# (the built transformers model, generator): values its initialiser leaves uninformative
TinyInit = Callable[[Any, Any], None]
_BUILDERS: dict[str, TinyBuilder] = {}
_MTP_WRITERS: dict[str, MtpWriter] = {}
_INITS: dict[str, TinyInit] = {}


def register_tiny(
    arch: str, builder: TinyBuilder, mtp: MtpWriter | None = None, init: TinyInit | None = None
) -> None:
    """Register the tiny-config builder of an architecture name (e.g. ``"granite_hybrid"``),
    the writer of its MTP head's tensors where it has one, and ``init``: seeded values for
    tensors transformers initialises to a constant (a routing bias of zeros would leave the
    code that adds it untested)."""
    _BUILDERS[arch] = builder
    if mtp is not None:
        _MTP_WRITERS[arch] = mtp
    if init is not None:
        _INITS[arch] = init


def mtp_archs() -> list[str]:
    """Names of the architectures whose tiny checkpoints can carry an MTP head."""
    tiny_archs()
    return sorted(_MTP_WRITERS)


def tiny_archs() -> list[str]:
    """Names of every architecture with a tiny builder."""
    from mambaradix.models import tiny_configs  # noqa: F401  (registers the builders)

    return sorted(_BUILDERS)


def size_dims(size: str) -> dict[str, int]:
    """Common dimensions of a size: hidden, layers, heads, kv_heads, head_dim, intermediate,
    vocab. Builders pick what their architecture needs."""
    dims = {
        "tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                     vocab=512),
        "small": dict(hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=512,
                      vocab=1024),
        "mid": dict(hidden=1024, layers=12, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
                    vocab=4096),
    }  # fmt: skip
    if size not in dims:
        raise ValueError(f"unknown tiny size {size!r}; choose one of {SIZES}")
    return dict(dims[size])


# --------------------------------------------------------------------------- tokenizer

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their has been would more when if will "
    "model cache state token prefix request batch layer attention recurrent memory snapshot "
    "system prompt question answer engine server stream tree node slot page chunk decode "
    "prefill hybrid mamba delta convolution kernel tensor python code data time number world "
    "people water house light music river mountain city country language story letter family "
    "quick brown fox jumps over lazy dog hello thanks please user assistant write explain why "
    "how what where who first second third small large fast slow good new old great little"
).split()


def _corpus(n_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        s = " ".join(words)
        lines.append(s[0].upper() + s[1:] + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens: the
    ChatML specials (ids 0..2), the 256 byte symbols, merges, and reserved fillers if the corpus
    runs out of merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fill = vocab_size - tok.get_vocab_size()
    if fill > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(fill)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------- checkpoints


def make_tiny_checkpoint(
    arch: str, path: str, seed: int = 0, size: str = "tiny", mtp: bool = False, **overrides: Any
) -> str:
    """Write a seeded random fp32 checkpoint of ``arch`` + tokenizer into ``path``; returns it.

    ``mtp``: add the MTP head's tensors and config fields (``mtp_archs()``). ``overrides`` go
    to the builder (config fields such as ``initializer_range``)."""
    import torch

    archs = tiny_archs()
    if arch not in _BUILDERS:
        raise ValueError(f"unknown tiny architecture {arch!r}; available: {archs}")
    if mtp and arch not in _MTP_WRITERS:
        raise ValueError(f"tiny {arch!r} has no MTP head; these do: {mtp_archs()}")
    config, model_cls = _BUILDERS[arch](size, **overrides)
    tokenizer = build_tokenizer(config.get_text_config().vocab_size)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    for cfg in {
        id(config): config,
        id(config.get_text_config()): config.get_text_config(),
    }.values():
        cfg.eos_token_id = eos
        cfg.pad_token_id = eos[0]
        cfg.bos_token_id = None
    torch.manual_seed(seed)
    if hasattr(model_cls, "from_config"):
        model = model_cls.from_config(config, dtype=torch.float32)
    else:
        model = model_cls(config)
    model = model.float().eval()
    if arch in _INITS:
        with torch.no_grad():
            _INITS[arch](model, torch.Generator().manual_seed(seed + 2_000_003))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if mtp:
        _add_mtp(Path(path), config, _MTP_WRITERS[arch], seed)
    logger.info("wrote tiny %s (%s, seed %d) to %s", arch, size, seed, path)
    return path


def _add_mtp(folder: Path, config: Any, writer: MtpWriter, seed: int) -> None:
    """Add the writer's ``mtp.*`` tensors to the saved weights (one file: rewritten; shards: one
    more shard in the index) and its fields to config.json (``text_config`` where nested)."""
    import torch
    from safetensors.torch import load_file, save_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        tensors = {}
        for shard in sorted(set(meta["weight_map"].values())):
            tensors.update(load_file(str(folder / shard)))
    else:
        tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1_000_003)  # apart from the model's draws
    extra, fields = writer(config, tensors, gen)
    if index.is_file():
        save_file(extra, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
        meta["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
        index.write_text(json.dumps(meta, indent=2))
    else:
        tensors.update(extra)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = folder / "config.json"
    raw = json.loads(cfg_path.read_text())
    (raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw).update(fields)
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a seeded random hybrid-model checkpoint.")
    ap.add_argument("--arch", required=True, help="architecture name, e.g. qwen3_next")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--size", default="tiny", choices=SIZES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp", action="store_true", help="add the MTP draft head's weights")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    # Under ``python -m`` this file is ``__main__``; model modules register their builders in
    # the importable ``mambaradix.models.tiny``, so use that one.
    from mambaradix.models import tiny

    tiny.make_tiny_checkpoint(args.arch, args.out, seed=args.seed, size=args.size, mtp=args.mtp)


if __name__ == "__main__":
    main()
