"""Multimodal training systems: the image–caption contrastive stage with its gathers hidden
behind computation, the three-phase step that keeps the vision tower outside the language
model's parameter tree, and context-parallel loading of a long sequence's images.

Modules: :mod:`.data` (generated image–caption pairs and a counting image reader),
:mod:`.phases` (the three-phase step), :mod:`.contrastive` (features, the pairwise loss, the
distributed step), :mod:`.sharded` (CP-sharded image loading), :mod:`.run` (the processes
behind ``replaykv train --contrastive``).
"""
