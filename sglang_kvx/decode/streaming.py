"""``streamingllm`` at decode time: attention sinks plus a recent window, the rest evicted for good.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024,
arXiv:2309.17453): keep the first ``sinks`` tokens (the sinks every head dumps attention on) and
the ``window`` most recent, so generation of any length runs in bounded KV memory. Positions stay
the original ones here (keys are cached after RoPE), as in the paper's cache without re-rotation.
"""

from __future__ import annotations

from sglang_kvx.decode.base import DecodeStep, Span, register_decode_step


@register_decode_step("streamingllm")
class StreamingDecode(DecodeStep):
    options = ("sinks", "window")
    drops = True

    def __init__(self, *, sinks: int = 4, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.sinks, self.window = sinks, window
        self._span = Span(sinks=sinks, window=window)

    def span(self, step: int) -> Span:
        return self._span

    def live_tokens(self, prompt_len: int) -> int | None:
        # The prompt stays (the prefix cache may share it); the window slides over what follows.
        return prompt_len + self.window + 1

    def dropped(self, seq_len: int, num_layers: int) -> list[tuple[int, int]] | None:
        # The next step has seq_len + 1 keys: everything its window no longer reaches goes.
        start, end = self._span.hidden(seq_len + 1)
        return [(start, end)] * num_layers if end > start else None
