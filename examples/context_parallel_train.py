"""Train a tiny random GPT-OSS with its sequences sharded over the ranks (context parallel), and check every
step against the same model trained in one process on the whole sequences.

    torchrun --nproc-per-node 2 examples/context_parallel_train.py              # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 4 examples/context_parallel_train.py --layout contiguous --seqlen 64

Each rank holds ``seqlen / P`` tokens of every sequence (input ids and position ids cut by
``gstar.distributed.shard_sequence``); inside ``gstar.distributed.context_parallel`` the model's
``attn_implementation="gstar"`` layers (one 12-token sliding window, one full causal, learned sinks) see the
whole sequence through their exchanges. Labels are shifted on the whole sequence before they are sharded
(the last token of a shard predicts the first of another rank's), the loss is summed over ranks, and the
gradients are summed over ranks as data-parallel training sums them. Each rank also runs the unsharded
model (its own copy, same initialisation) on the whole batch: the losses and every parameter's gradient
must agree to float32 rounding (relative error below 1e-4, the float32 bar of gstar.lab.accuracy), step after
step. Exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import transformers

import gstar.distributed as gd
import gstar.integrations.transformers  # noqa: F401  (registers attn_implementation="gstar")
from gstar.lab.accuracy import relative_error

BAR = 1e-4  # float32: relative error of the loss and of each gradient


def build_model(seed: int, device) -> torch.nn.Module:
    """A tiny random GptOssForCausalLM in float32 (2 layers: a 12-token sliding window, then full causal)."""
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=12, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="gstar")
    return model.to(device=device, dtype=torch.float32).train()


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                             reduction="sum")


def _whole_step(model, ids, labels, count):
    """Loss and gradients of the unsharded model on the whole batch."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    loss = _loss_sum(model(input_ids=ids, position_ids=positions, use_cache=False).logits, labels) / count
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _sharded_step(model, ids, labels, count, group, layout):
    """Loss and gradients of the context-parallel model, both summed over the ranks."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    ids, positions, labels = (gd.shard_sequence(t, group, layout, dim=1) for t in (ids, positions, labels))
    with gd.context_parallel(group, layout):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits   # (B, n, vocab)
    loss = _loss_sum(logits, labels) / count
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss, group=group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    return loss, {n: p.grad for n, p in model.named_parameters()}


def train(*, steps: int = 3, batch: int = 2, seqlen: int = 32, layout: str = "zigzag", lr: float = 0.1,
          seed: int = 0, group=None, device="cpu", log=print) -> list[dict]:
    """Train the sharded and the whole model side by side with SGD; per step, both losses and the largest
    relative error of a gradient."""
    sharded = build_model(seed, device)
    whole = copy.deepcopy(sharded)
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (sharded, whole)]
    generator = torch.Generator().manual_seed(seed)
    report = []
    for step in range(steps):
        ids = torch.randint(0, 256, (batch, seqlen), generator=generator).to(device)   # the same on every rank
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # shifted before sharding
        count = int((labels != -100).sum())
        loss, grads = _sharded_step(sharded, ids, labels, count, group, layout)
        ref_loss, ref_grads = _whole_step(whole, ids, labels, count)
        errors = {n: relative_error(grads[n], g) for n, g in ref_grads.items() if g is not None}
        worst = max(errors, key=errors.get)
        row = {"step": step, "loss": float(loss), "loss_whole": float(ref_loss),
               "loss_error": relative_error(loss, ref_loss), "grad_error": errors[worst], "worst": worst,
               "missing_grads": sorted(n for n, g in grads.items() if g is None) != sorted(
                   n for n, g in ref_grads.items() if g is None)}
        log(f"step {step}: loss {row['loss']:.6f} (whole sequence {row['loss_whole']:.6f}), largest gradient "
            f"error {row['grad_error']:.2e} ({worst})")
        report.append(row)
        for optimizer in optimizers:
            optimizer.step()
    return report


def agrees(report: list[dict]) -> bool:
    return all(r["loss_error"] < BAR and r["grad_error"] < BAR and not r["missing_grads"] for r in report)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=32, help="tokens per sequence, a multiple of 2 x ranks (zigzag)")
    p.add_argument("--layout", choices=gd.LAYOUTS, default="zigzag")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    log = print if rank == 0 else (lambda *a: None)
    log(f"{dist.get_world_size()} ranks ({dist.get_backend()}), layout {args.layout}, {args.seqlen} tokens")
    report = train(steps=args.steps, batch=args.batch, seqlen=args.seqlen, layout=args.layout, device=device, log=log)
    ok = agrees(report)
    log("loss and gradients match the whole-sequence run" if ok else "MISMATCH with the whole-sequence run")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
