"""``pp-core run|validate|export`` (placeholder until the YAML pipeline lands)."""


def register(subparsers) -> None:
    subparsers.add_parser("run", help="run a YAML pipeline")
