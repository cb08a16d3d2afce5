"""Model and tokenizer loading, and the embedded default: a tiny Qwen2 model made from a config.

Everything loads through `load_tokenizer` / `load_model`, so the embedded model (a directory written by
`build_tiny_model`) and a real one (`Qwen/Qwen2.5-0.5B-Instruct`, a hub id or a local directory) take the
same path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from areal_pipeline.utils import atomic_directory, get_logger

logger = get_logger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

# Qwen2's chat format without its default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def build_byte_tokenizer():
    """A byte-level tokenizer (id = byte value, then the special tokens) with Qwen2's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        model_max_length=1 << 20,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen2_config(tokenizer, tiny: Any):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        torch_dtype="float32",
    )


def build_tiny_model(out_dir: str | Path, tiny: Any = None, seed: int = 1) -> Path:
    """Write the tiny Qwen2 model + tokenizer as a Hugging Face directory: random weights, warm-started
    when `tiny.pretrain_steps` > 0."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from areal_pipeline.config import TinyModelConfig

    tiny = tiny or TinyModelConfig()
    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer()
    config = tiny_qwen2_config(tokenizer, tiny)
    with atomic_directory(out_dir) as tmp:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        if tiny.pretrain_steps > 0:
            from areal_pipeline.warm_start import warm_start

            warm_start(model, tokenizer, tiny, seed)
        model.generation_config = GenerationConfig(
            eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    logger.info("built tiny model (%d parameters) in %s", sum(p.numel() for p in model.parameters()), out_dir)
    return out_dir


def embedded_model_dir(output_dir: str | Path, tiny: Any, seed: int) -> Path:
    """Where the embedded model of this config and seed is built: named by a digest of everything that decides
    its weights, the code that builds and warm-starts it included (a changed curriculum builds a new model
    instead of reusing one made by the old code)."""
    key = json.dumps({"tiny": dataclasses.asdict(tiny), "seed": seed, "code": _build_code_digest(tiny)},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(output_dir) / "_models" / f"tiny-qwen2-{digest}"


def _build_code_digest(tiny: Any) -> str:
    """sha256 of the sources that build the model: this module, and with a warm start the curriculum's module and
    the warm-start loop."""
    import importlib.util

    modules = [__name__]
    if tiny.pretrain_steps > 0:
        from areal_pipeline.warm_start import CURRICULA

        modules += ["areal_pipeline.warm_start", CURRICULA[tiny.pretrain_task].split(":")[0]]
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(importlib.util.find_spec(module).origin).read_bytes())
    return digest.hexdigest()[:16]


def resolve_model_path(model_cfg: Any, output_dir: str | Path, seed: int) -> str:
    """The model directory or hub id to load: `model.path`, else the embedded model (built on first use)."""
    from areal_pipeline.config import validate

    # load_config checked this already; a config built in code (dataclasses.replace) did not pass through it.
    validate(model_cfg, prefix="model.")
    if model_cfg.path:
        return model_cfg.path
    path = embedded_model_dir(output_dir, model_cfg.tiny, seed)
    if not (path / "config.json").is_file():
        build_tiny_model(path, model_cfg.tiny, seed)
    return str(path)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_model(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu",
               trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; valid: {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()


def eos_token_ids(tokenizer, model_config=None) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS plus the model's generation EOS ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(i) for i in eos)
    return sorted(ids)
