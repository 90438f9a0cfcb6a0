"""The directory ``python -m adapter.run`` puts on its children's PYTHONPATH (see sitecustomize.py here).

A package only so that setuptools ships it with the adapter; nothing imports it as ``adapter._spawn_hook``.
"""
