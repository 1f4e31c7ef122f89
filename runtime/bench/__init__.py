"""``runtime bench``: the runtime against mlx-lm on the same model, in the same run.

Entry points: ``runtime bench ...`` (the CLI forwards its argv to :func:`runtime.bench.main.main`)
or ``python -m runtime.bench ...`` from the repository root.
"""
