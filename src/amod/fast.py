"""``amod.compile``: the fast inference path in one call.

A small ViT's forward on a GPU is a few milliseconds, and in eager PyTorch each of its operations costs a kernel
launch and the Python and dispatcher work around it; a model that reduces tokens runs about twice as many operations
as the dense one (``amod.tools.opcount``), so in eager mode it is bound by launches, not by its MACs. Compiled
as one graph with static shapes (``torch.compile(fullgraph=True, dynamic=False)``), the reduction's small operations
fuse with their neighbours; replayed as a CUDA graph (``mode="reduce-overhead"``), a forward costs its kernels alone.
``mode="cuda-graphs"`` records the eager forward as a CUDA graph without compiling (``CapturedGraph``): built in the
time of a few forwards, its kernels are eager PyTorch's, its launches gone.

Everything a converted model computes has static shapes at a given batch and image size (top-k, gathers and
scatter-adds of fixed sizes; no boolean masks, no host synchronisation), and the settings its forward reads are
compile-time constants (``amod.static``): changing the capacity, or the batch size, compiles a new graph (the first
call after the change pays for it), and the graphs already compiled are kept for when they come back: up to ``GRAPHS``
of them per compiled model. Torch keeps 8 per function (``torch._dynamo.config.recompile_limit``), and with
``fullgraph=True`` the 9th fails (``FailOnRecompileLimitHit``); amod raises the limit for its own compiled models
only (``torch.compile(recompile_limit=)``, or the setting patched around each call on a torch without it), the
user's other compiled functions keep torch's.
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Optional

import torch
from torch import nn
from .errors import UserError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's
MODES = (*COMPILE_MODES, "cuda-graphs")
GRAPHS = 64  # graphs one compiled model keeps (a capacity, batch size or image size each); torch's own limit is 8


class _Autocast(nn.Module):
    """``model`` run under ``torch.autocast`` of its device at ``dtype``, inside the compiled graph."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=self.dtype):
            return self.model(*args, **kwargs)


def compile(model: nn.Module, example: Optional[torch.Tensor] = None, *, cuda_graphs: Optional[bool] = None,
            dtype: Optional[torch.dtype] = None, mode: Optional[str] = None, backend: Optional[Any] = None
            ) -> nn.Module:
    """Compile a model (dense or amod-converted, any family) for inference: one graph, static shapes, and on a GPU
    CUDA graphs.

    Args:
        model: the model to run, in eval mode on its device (it is not changed; the result calls it).
        example: a batch of the size and shape the model will run at: compiled (and its CUDA graph recorded) now,
            the seconds that took in ``compiled.amod_compile_seconds``; without it, at the first calls.
        cuda_graphs: replay CUDA graphs (``mode="reduce-overhead"``); default: where the model is on a GPU.
        dtype: run under ``torch.autocast`` at this dtype (e.g. ``torch.bfloat16``), inside the graph.
        mode: ``torch.compile``'s mode instead (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``), or
            ``"cuda-graphs"``: the eager forward recorded as a CUDA graph, no compiling (``CapturedGraph``; needs a
            model on a GPU and ``example``).
        backend: ``torch.compile``'s backend (default: its own, inductor).

    Returns:
        The compiled module; call it under ``torch.inference_mode()`` as the model. A graph break raises (the whole
        forward is one graph, or the call fails naming where it is not). With CUDA graphs, an output is overwritten
        by the next call: clone what you keep. Each capacity, batch size or image size it meets compiles a graph of
        its own, kept for when it comes back, up to ``GRAPHS`` (64); a call that needs one more raises torch's
        ``FailOnRecompileLimitHit`` (``torch._dynamo.reset()`` drops every compiled graph).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amod.compile takes an nn.Module, got {type(model).__name__}")
    if model.training:
        raise UserError("amod.compile is the inference path: call model.eval() first")
    on_gpu = next(model.parameters()).device.type == "cuda"
    if mode is None:
        mode = "reduce-overhead" if (on_gpu if cuda_graphs is None else cuda_graphs) else "default"
    elif cuda_graphs is not None:
        raise UserError("give cuda_graphs= or mode=, not both")
    if mode not in MODES:
        raise UserError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    target = model if dtype is None else _Autocast(model, dtype)
    if mode == "cuda-graphs":
        if example is None or not on_gpu:
            raise UserError("mode='cuda-graphs' records a CUDA graph: give a model on a GPU and an example batch")
        start = time.perf_counter()
        captured = CapturedGraph(target, example)
        captured.amod_compile_seconds = time.perf_counter() - start
        return captured
    compiled = _compile_keeping_graphs(target, fullgraph=True, dynamic=False, mode=mode,
                                       **({} if backend is None else {"backend": backend}))
    compiled.amod_compile_seconds = None
    if example is not None:
        compiled.amod_compile_seconds = warm_up(compiled, example)
    return compiled


class _KeepingGraphs(nn.Module):
    """``compiled`` called with torch's per-function graph limit raised to ``GRAPHS`` for the call (the limit is read
    when a call compiles): a torch whose ``torch.compile`` takes no ``recompile_limit``."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(cache_size_limit=GRAPHS):  # (the older name of recompile_limit)
            return self.compiled(*args, **kwargs)


def _compile_keeping_graphs(target: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.compile(target, **kwargs)`` that keeps up to ``GRAPHS`` graphs, not torch's 8, without changing the limit
    of any other compiled function."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(target, recompile_limit=GRAPHS, **kwargs)
    return _KeepingGraphs(torch.compile(target, **kwargs))


def warm_up(compiled: nn.Module, example: torch.Tensor, calls: int = 3) -> float:
    """Call ``compiled`` on ``example`` ``calls`` times (compile, record the CUDA graph, replay it once) under
    ``torch.inference_mode``; returns the seconds it took, the device synchronised."""
    sync = torch.cuda.synchronize if example.device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(calls):
            compiled(example)
    sync()
    return time.perf_counter() - start


class CapturedGraph(nn.Module):
    """``model``'s inference forward on batches shaped like ``example``, recorded once as a CUDA graph and replayed:
    each call copies its input into the recorded one, replays the graph and returns the recorded output (overwritten
    by the next call). A model whose forward draws random numbers (amod's random routers) is refused: a graph would
    replay one draw for ever."""

    def __init__(self, model: nn.Module, example: torch.Tensor, warmup: int = 3) -> None:
        super().__init__()
        from .mod.routers import SeededDraws

        if any(isinstance(m, SeededDraws) for m in model.modules()):
            raise UserError("the model's router draws new random numbers every forward, and a CUDA graph replays "
                            "the draws it recorded: use mode='reduce-overhead' (torch.compile) or eager PyTorch")
        self.model = model
        self.example_input = example.clone()
        side = torch.cuda.Stream(example.device)
        side.wait_stream(torch.cuda.current_stream(example.device))
        with torch.cuda.stream(side), torch.inference_mode():  # (kernels and workspaces made before recording)
            for _ in range(warmup):
                model(self.example_input)
        torch.cuda.current_stream(example.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.example_output = model(self.example_input)
        torch.cuda.synchronize(example.device)

    def forward(self, x: torch.Tensor) -> Any:
        ref = self.example_input
        if x.shape != ref.shape or x.dtype != ref.dtype or x.device != ref.device:
            raise UserError(f"this CUDA graph was recorded for inputs {tuple(ref.shape)} {ref.dtype} on {ref.device}, "
                            f"got {tuple(x.shape)} {x.dtype} on {x.device}: record one for this shape with "
                            "amod.compile(model, example, mode='cuda-graphs')")
        ref.copy_(x)
        self.graph.replay()
        return self.example_output
