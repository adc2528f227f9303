"""Worker (r, s): one pipeline stage of one replica, written sans-IO.

A worker never sleeps, opens a socket or reads a clock. A driver hands it events (``receive`` a
message) and asks it for work (``next_action``); ``run`` performs the real forward or backward and
returns the messages to send. What the simulator tests is therefore exactly what a real process runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshlearn.compress.codecs import Codec, Encoded, Kind
from meshlearn.mesh.compute import StageShape
from meshlearn.mesh.messages import Message
from meshlearn.mesh.schedule import Action
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.llama import Decoder

Tamper = Callable[[Kind, int, int, torch.Tensor], torch.Tensor]
"""(kind, step, microbatch, tensor) → the tensor actually sent; see ``meshlearn.verify.attacks``."""


@dataclass
class StepWork:
    """What one worker does in one optimizer step."""

    step: int
    plan: list[Action]
    microbatch_size: int  # sequences per microbatch, for FLOP counting on every stage
    tokens: list[torch.Tensor] | None = None  # first stage: input ids per microbatch
    targets: list[torch.Tensor] | None = None  # last stage: next-token ids per microbatch
    position: int = 0
    inbox: dict[tuple[str, int], Encoded] = field(default_factory=dict)
    ids: dict[int, torch.Tensor | None] = field(default_factory=dict)  # token ids, for id-aware codecs
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)  # microbatches a verifier quarantined upstream


class Worker:
    def __init__(self, wid: WorkerId, mesh: MeshShape, module: Decoder,
                 optimizer: torch.optim.Optimizer, codec: Codec):
        self.id = wid
        self.mesh = mesh
        self.module = module
        self.optimizer = optimizer
        self.codec = codec
        self.is_first = wid.stage == 0
        self.is_last = wid.stage == mesh.stages - 1
        self.shape = StageShape(len(module.layers), module.tok_emb is not None, module.head is not None)
        self.n_params = sum(p.numel() for p in module.parameters())
        self.work: StepWork | None = None
        # Sees the full-width gradient at this stage's input before it is encoded (for statistics
        # such as the subspace basis update); None when nobody listens.
        self.input_grad_observer: Callable[[torch.Tensor], None] | None = None
        # An adversarial worker: rewrites each tensor it is about to send (before encoding), while
        # its own forward/backward stay honest. None for an honest worker.
        self.tamper: Tamper | None = None
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])

    # --- the pipeline step -------------------------------------------------------------------

    def begin_step(self, work: StepWork) -> None:
        if self.is_first and work.tokens is None:
            raise ValueError(f"worker {self.id}: the first stage needs input tokens")
        if self.is_last and work.targets is None:
            raise ValueError(f"worker {self.id}: the last stage needs targets")
        self.work = work

    @property
    def finished(self) -> bool:
        return self.work is None or self.work.position >= len(self.work.plan)

    def next_action(self) -> Action | None:
        """The next planned action if its input has arrived; None while waiting (or when done)."""
        if self.finished:
            return None
        action = self.work.plan[self.work.position]
        if action.kind == "F" and not self.is_first and ("act", action.microbatch) not in self.work.inbox:
            return None
        if action.kind == "B" and not self.is_last and ("grad", action.microbatch) not in self.work.inbox:
            return None
        return action

    def receive(self, message: Message) -> None:
        if self.work is None or message.step != self.work.step:
            raise RuntimeError(f"worker {self.id}: message for step {message.step} outside that step")
        self.work.inbox[(message.kind, message.microbatch)] = message.payload
        if message.skip:  # propagate: every later message of this microbatch carries the flag
            self.work.skipped.add(message.microbatch)

    def run(self, action: Action) -> list[Message]:
        """Perform ``action`` (must be the one ``next_action`` returned) and return what to send."""
        assert self.work is not None and action == self.next_action(), f"{self.id}: {action} not ready"
        self.work.position += 1
        if action.kind == "F":
            return self._forward(action.microbatch)
        return self._backward(action.microbatch)

    def _forward(self, m: int) -> list[Message]:
        work = self.work
        if self.is_first:
            inputs = None
            work.ids[m] = work.tokens[m]
            out = self.module(work.tokens[m])
        else:
            message = work.inbox.pop(("act", m))
            work.ids[m] = message.tensors.get("ids")
            inputs = self.codec.decode(message, "act").requires_grad_(True)
            out = self.module(inputs)
        if self.is_last:
            loss = Decoder.loss(out, work.targets[m])
            if m in work.skipped:
                # Quarantined upstream: zero weight, so the microbatch moves no weight anywhere, and
                # its loss stays out of the train loss.
                work.saved[m] = (inputs, loss * 0.0)
                return []
            work.losses[m] = loss.item()
            # Each microbatch's mean loss counts 1/M: the step's gradient is the batch mean.
            work.saved[m] = (inputs, loss / len(work.targets))
            return []
        work.saved[m] = (inputs, out)
        dst = self.mesh.next_stage(self.id)
        sent = self._tampered("act", m, out.detach())
        return [Message("act", work.step, m, self.id, dst, self.codec.encode(sent, "act", work.ids[m]),
                        skip=m in work.skipped)]

    def _backward(self, m: int) -> list[Message]:
        work = self.work
        inputs, out = work.saved.pop(m)
        if self.is_last:
            out.backward()
        else:
            out.backward(self.codec.decode(work.inbox.pop(("grad", m)), "grad"))
        ids = work.ids.pop(m)
        if self.is_first:
            return []
        if self.input_grad_observer is not None:
            self.input_grad_observer(inputs.grad)
        dst = self.mesh.prev_stage(self.id)
        sent = self._tampered("grad", m, inputs.grad)
        return [Message("grad", work.step, m, self.id, dst, self.codec.encode(sent, "grad", ids),
                        skip=m in work.skipped)]

    def _tampered(self, kind: Kind, m: int, x: torch.Tensor) -> torch.Tensor:
        return x if self.tamper is None else self.tamper(kind, self.work.step, m, x)

    def end_step(self) -> dict[int, float]:
        """Close the step; return the last stage's microbatch losses (empty on other stages)."""
        assert self.work is not None and self.finished, f"{self.id}: step not finished"
        losses, self.work = self.work.losses, None
        return losses

    # --- the update --------------------------------------------------------------------------

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def grad_sq_norm(self) -> float:
        return float(sum(g.pow(2).sum() for g in self.grads()))

    def apply_update(self, lr_factor: float, clip_coef: float) -> None:
        """Scale gradients by the global clip coefficient, set the scheduled lr, step, zero."""
        if clip_coef < 1.0:
            for g in self.grads():
                g.mul_(clip_coef)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lr_factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
