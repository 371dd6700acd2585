"""Training replaykv's small DeepSeek-V4.1 model: data, recipes, grad-enabled replay paths, loop.

`replaykv train --recipe tiny|small|adapt --out DIR` (see :mod:`replaykv.train.cli`). Not for:
serving or the engine, which never import this package.
"""
