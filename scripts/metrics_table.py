"""Print the Markdown table of every metric replaykv exports (the list in docs/metrics.md)."""

from replaykv.engine.metrics import catalogue, markdown_table
from replaykv.server.metrics import HTTP_METRICS

if __name__ == "__main__":
    print(markdown_table([*catalogue(), *HTTP_METRICS]), end="")
