"""Operators and kernels one layer call launches, per DeepSeek-V4.1 layer role, in a prefill and in
one decode step, next to DeepSeek's 15 (prefill) and 11 (decode) fused kernels per Reuse layer.

    python bench/bench_kernels.py [--preset v41-small] [--context 1024] [--device cpu|cuda] [--json FILE]
        [--compile]

Each layer's call is wrapped in a profiler range (forward hooks); inside it the script counts

    ops           top-level operators the layer dispatches (aten calls whose parent is the layer's
                  range: on a CPU each runs one or more kernels of its own) and its native kernel
                  calls (`replaykv.model.native`, each one kernel, given a profiler range of its
                  own by `bench_limits.NativeCalls`); NumPy work such as the small mHC Sinkhorn of
                  a CPU decode step is not an operator and is not counted
    CUDA kernels  device kernels launched from inside the range (on a GPU)
    host reads    reads of tensor values by the host inside the range: on a GPU its device-to-host
                  copies (each waits for the device, and none can be captured in a CUDA graph), on
                  a CPU the scalar reads (aten::_local_scalar_dense; `.tolist()` of a CPU tensor
                  reads memory without an operator and is not counted)

The prefill is one forward of `--context` tokens into an empty cache; the decode step is one
token after it (one warm-up decode step first), float32 weights as the engine runs them. On a GPU the script also tries to capture the
decode step in a CUDA graph and prints whether that worked or the error that stopped it.
Counts are exact for a given torch version and preset; no timing is taken.

With --compile the script also compiles the first Reuse layer's forward with torch.compile
(inductor, static shapes) and runs one prefill and one decode step through it, each compiled
afresh, and reports what inductor made of each call: the graphs (and graph breaks between them)
and the kernels it generated (`torch._inductor.metrics.generated_kernel_count`; matrix products
stay library calls and are not among them, nor are the operators run eagerly at a graph break).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_limits import NativeCalls  # noqa: E402

from replaykv.cache.views import advance, allocate_view  # noqa: E402
from replaykv.model.init import init_weights  # noqa: E402
from replaykv.model.presets_v41 import get_preset_v41  # noqa: E402
from replaykv.model.spec import ModelSpec  # noqa: E402
from replaykv.model.v41 import DeepseekV41ForCausalLM  # noqa: E402

DEEPSEEK_REUSE = {"prefill": 15, "decode": 11}  # fused kernels per Reuse layer (first source document)


def _descendants(evt: Any) -> list[Any]:
    out, todo = [], list(evt.cpu_children)
    while todo:
        e = todo.pop()
        out.append(e)
        todo.extend(e.cpu_children)
    return out


def count_layers(
    model: DeepseekV41ForCausalLM,
    run: Callable[[], None],
    device: torch.device,
    names: dict[int, Counter[str]] | None = None,
) -> dict[int, dict[str, int]]:
    """Per layer index: ops, CUDA kernels and host reads of one call of `run` (and, into `names`
    when given, how many of each top-level operator the layer dispatched)."""
    open_ranges: dict[int, Any] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):

        def pre(mod: Any, args: Any, i: int = i) -> None:
            rf = torch.autograd.profiler.record_function(f"layer:{i}")
            rf.__enter__()
            open_ranges[i] = rf

        def post(mod: Any, args: Any, out: Any, i: int = i) -> None:
            open_ranges.pop(i).__exit__(None, None, None)

        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof, NativeCalls():
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        for h in handles:
            h.remove()
    counts: dict[int, dict[str, int]] = {}
    for evt in prof.events():
        if not evt.name.startswith("layer:") or evt.device_type != DeviceType.CPU:
            continue  # a GPU timeline's copy of the range (gpu_user_annotation) has no children
        inside = _descendants(evt)
        kernels = [k for e in [evt, *inside] for k in getattr(e, "kernels", [])]
        if device.type == "cuda":
            reads = sum(1 for k in kernels if "DtoH" in k.name)
        else:
            reads = sum(1 for e in inside if e.name == "aten::_local_scalar_dense")
        if names is not None:
            top = [c.name for c in evt.cpu_children if not c.name.startswith("layer:")]
            names[int(evt.name.split(":")[1])] = Counter(top)
        counts[int(evt.name.split(":")[1])] = {
            "ops": sum(1 for c in evt.cpu_children if not c.name.startswith("layer:")),
            "cuda_kernels": sum(1 for k in kernels if "Memcpy" not in k.name and "Memset" not in k.name),
            "host_reads": reads,
        }
    return counts


def by_role(model: DeepseekV41ForCausalLM, counts: dict[int, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """Per layer role: the layers, and each count's distinct values over them."""
    roles: dict[str, dict[str, Any]] = {}
    for i, c in sorted(counts.items()):
        role = model.config.layer_role(i)
        r = roles.setdefault(role, {"layers": []} | {k: Counter() for k in c})
        r["layers"].append(i)
        for k, v in c.items():
            r[k][v] += 1
    return roles


def compiled_counts(layer: torch.nn.Module, run: Callable[[], None]) -> dict[str, Any]:
    """Graphs, graph breaks and generated kernels of one call of `run` with `layer`'s forward
    compiled by inductor from scratch; or the error that stopped the compilation."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    counters.clear()
    layer.forward = torch.compile(layer.forward, backend="inductor", dynamic=False)
    try:
        run()
    except Exception as e:  # the error itself is the result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    finally:
        del layer.forward  # the class's forward again
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "generated_kernels": int(metrics.generated_kernel_count),
        "break_reasons": sorted({str(k).splitlines()[0][:120] for k in counters["graph_break"]}),
    }


def try_cuda_graph(step: Callable[[], None]) -> str:
    """Capture one decode step in a CUDA graph and replay it; 'ok' or the error that stopped it."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # the error itself is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v41-small")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--compile", action="store_true", help="also count inductor's kernels for a Reuse layer")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(get_preset_v41(args.preset))
    init_weights(model, seed=0)
    model = model.to(device=device, dtype=dtype).eval()
    spec = ModelSpec.from_config(model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context + 8), device=device)
    view = allocate_view(spec, 1, args.context + 8, device=device, dtype=dtype)
    result: dict[str, Any] = {
        "preset": args.preset,
        "context": args.context,
        "device": str(device),
        "torch": torch.__version__,
    }
    with torch.inference_mode():

        def prefill() -> None:
            model(ids[:, : args.context], view, logits_rows="last")

        result["prefill"] = by_role(model, count_layers(model, prefill, device))
        advance(view, args.context)
        model(ids[:, args.context : args.context + 1], view, logits_rows="last")  # warm-up decode
        advance(view, 1)
        pos = args.context + 1

        def decode() -> None:
            model(ids[:, pos : pos + 1], view, logits_rows="last")

        decode_names: dict[int, Counter[str]] = {}
        result["decode"] = by_role(model, count_layers(model, decode, device, decode_names))
        reuse = result["decode"].get("reuse", {}).get("layers", [])
        if reuse:
            result["decode_reuse_ops"] = dict(decode_names[reuse[0]].most_common())
        if device.type == "cuda":
            result["cuda_graph_decode"] = try_cuda_graph(decode)
        if args.compile and reuse:
            layer = model.model.layers[reuse[0]]
            fresh = allocate_view(spec, 1, args.context + 8, device=device, dtype=dtype)

            def compiled_prefill() -> None:
                model(ids[:, : args.context], fresh, logits_rows="last")

            result["compiled_reuse"] = {
                "layer": reuse[0],
                "prefill": compiled_counts(layer, compiled_prefill),
            }
            advance(fresh, args.context)
            result["compiled_reuse"]["decode"] = compiled_counts(
                layer, lambda: model(ids[:, args.context : args.context + 1], fresh, logits_rows="last")
            )
    print(
        f"{args.preset}, {args.context}-token prefill and one decode step after it, {device}, float32, torch {torch.__version__}"
    )
    print(
        "| phase | role | layers | ops per layer | CUDA kernels per layer | host reads per layer | DeepSeek (Reuse) |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for phase in ("prefill", "decode"):
        for role, r in result[phase].items():
            vals = {k: "/".join(str(v) for v in sorted(r[k])) for k in ("ops", "cuda_kernels", "host_reads")}
            ds = DEEPSEEK_REUSE[phase] if role == "reuse" else ""
            print(
                f"| {phase} | {role} | {','.join(map(str, r['layers']))} | {vals['ops']} | "
                f"{vals['cuda_kernels'] if device.type == 'cuda' else '-'} | {vals['host_reads']} | {ds} |"
            )
    if "decode_reuse_ops" in result:
        ops = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in result["decode_reuse_ops"].items())
        print(
            f"operators of a Reuse layer's decode step (layer {result['decode']['reuse']['layers'][0]}): {ops}"
        )
    if "compiled_reuse" in result:
        c = result["compiled_reuse"]
        for phase in ("prefill", "decode"):
            r = c[phase]
            if "error" in r:
                print(f"torch.compile of Reuse layer {c['layer']}, {phase}: {r['error']}")
            else:
                print(
                    f"torch.compile of Reuse layer {c['layer']}, {phase}: {r['graphs']} graphs, "
                    f"{r['graph_breaks']} graph breaks, {r['generated_kernels']} generated kernels "
                    f"(breaks: {'; '.join(r['break_reasons'])})"
                )
    if "cuda_graph_decode" in result:
        print(f"CUDA-graph capture of the decode step: {result['cuda_graph_decode']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=lambda c: dict(c)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
