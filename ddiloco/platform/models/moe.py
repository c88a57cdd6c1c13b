"""GPT whose MLPs are top-k mixtures of experts with a Switch/GShard load-balancing loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.platform.config import ModelConfig
from ddiloco.platform.models.gpt import GPT, MLP


class MoEMLP(nn.Module):
    """Router + ``n_experts`` GELU MLPs; each token goes to its ``top_k`` experts.

    After ``forward``, ``aux_loss`` holds n_experts * sum_i(f_i * P_i), where f_i is the fraction of
    routing assignments sent to expert i and P_i the mean router probability of expert i (1.0 when
    perfectly balanced)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, dropout: float) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(d_model, dropout) for _ in range(n_experts))
        self.aux_loss: torch.Tensor = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, C)
        probs = F.softmax(self.router(flat), dim=-1)  # (N, E)
        gates, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.top_k > 1:
            # Renormalise over the chosen experts; with k = 1 keep the raw probability (Switch) so
            # the router still receives a gradient through the gate.
            gates = gates / gates.sum(dim=-1, keepdim=True)

        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts).to(probs.dtype)
        fraction = counts / chosen.numel()
        self.aux_loss = self.n_experts * torch.sum(fraction * probs.mean(dim=0))

        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * gates[token, slot].unsqueeze(-1)
            out.index_add_(0, token, y)
        return out.reshape(shape)


class MoEGPT(GPT):
    """The GPT with every MLP replaced by a :class:`MoEMLP`; ``aux_loss`` averages the layers'."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, make_mlp=lambda: MoEMLP(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.dropout))
        self.aux_loss_coef = cfg.aux_loss_coef

    @property
    def aux_loss(self) -> torch.Tensor:
        losses = [block.mlp.aux_loss for block in self.blocks]
        return torch.stack(losses).mean()
