"""Training on the tasks of ``gdn_jax.data``: configs, the train step and loop, checkpoints,
run directories, meshes, several runs as one program, and ``train.py``'s command line.

Each module is imported where it is used; this package re-exports nothing, so importing it
loads neither optax nor orbax.
"""
