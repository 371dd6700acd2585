# The README's two commands: `make serve` (install + run the main job) and `make test`.
.PHONY: serve test install lint bench

serve:
	scripts/install.sh serve
	.venv/bin/replaykv serve --enable-encoder-swa-bounded-replay --enable-decoder-swa-bounded-replay

test:
	scripts/test.sh

lint:
	.venv/bin/ruff check replaykv tests bench
	.venv/bin/mypy replaykv bench
