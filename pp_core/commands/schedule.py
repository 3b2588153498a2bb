"""``pp-core schedule show|simulate|export`` (placeholder until the schedule tools land)."""


def register(subparsers) -> None:
    subparsers.add_parser("schedule", help="show, simulate or export a schedule")
