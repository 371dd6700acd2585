"""Capacity planner: deployment figures of a DeepSeek-V4 / V4.1 config under a workload.

Python API::

    from replaykv.plan import Workload, load_model_config, plan, format_table, write_plots
    p = plan(load_model_config("v41-flash"), Workload(swa_ttl=300.0))
    print(format_table(p)); write_plots(p, "out/")

The multimodal loading condition (``replaykv plan --loading``)::

    from replaykv.plan import DataMix, Hardware, format_loading, loading_report
    print(format_loading(loading_report(load_model_config("v41-flash"), DataMix(), Hardware(2e9, 900e12))))

Command line: :func:`replaykv.plan.cli.main` (``python -m replaykv.plan.cli --help``).
Uses only the model's configs and accounting; the engine does not import this package.
"""

from __future__ import annotations

from replaykv.plan.loading import DataMix, Hardware, format_loading, loading_report
from replaykv.plan.planner import Plan, format_table, load_model_config, plan
from replaykv.plan.plots import write_plots
from replaykv.plan.workload import (
    Distribution,
    MultimodalLoad,
    Workload,
    load_workload,
    parse_distribution,
    workload_from_dict,
)

__all__ = [
    "DataMix",
    "Distribution",
    "Hardware",
    "MultimodalLoad",
    "Plan",
    "Workload",
    "format_loading",
    "format_table",
    "load_model_config",
    "load_workload",
    "loading_report",
    "parse_distribution",
    "plan",
    "workload_from_dict",
    "write_plots",
]
