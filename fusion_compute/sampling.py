"""Token sampling on the client: greedy, temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits_V: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits_V))
        logits = logits_V.float() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            # Drop tokens once the mass before them already reaches top_p (always keep the first).
            drop = (cum - torch.softmax(sorted_logits, -1)) >= p.top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.gen))
