"""Sub-commands of ``pp-core``: each module has ``register(subparsers)``."""
