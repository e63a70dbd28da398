"""The learned-gate family's checkpoints and real test-split text, for the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cell_path(cell: str) -> str:
    return str(ROOT / "weights" / "gated" / cell)


def split_prompt(cell: str, length: int) -> list[int]:
    """Real text of the checkpoint's test split (its manifest names the documents), tokenised by its tokenizer."""
    from transformers import AutoTokenizer

    from sglang_kvx.training.train_gated import load_documents

    manifest = json.loads((Path(cell_path(cell)) / "manifest.json").read_text())
    docs, _ = load_documents(manifest["args"]["sources"].split(","), manifest["args"]["doc_chars"])
    text = {d["id"]: d["text"] for d in docs}[manifest["split"]["test"][0]]
    ids = AutoTokenizer.from_pretrained(cell_path(cell)).encode(text, add_special_tokens=False)
    assert len(ids) >= length
    return ids[:length]
