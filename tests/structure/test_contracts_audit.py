"""Regressions found by exercising the public contracts as an outside user."""

import pytest

from pp_core import ScheduleDef, ScheduleError, hookimpl
from pp_core.schedule.build import build_schedule
from pp_core.testing import plugins_with


def test_plugin_generator_that_raises_is_a_schedule_error_naming_the_schedule():
    def broken(num_stages, num_microbatches, num_ranks):
        raise TypeError("'ActionKind' object is not callable")

    class Broken:
        @hookimpl
        def pp_register_schedules(self, register):
            register("broken_sched", ScheduleDef(generate=broken))

    plugins = plugins_with(Broken())
    with pytest.raises(ScheduleError, match=r"schedule 'broken_sched': its generator failed .*"
                                            r"TypeError: 'ActionKind' object is not callable"):
        build_schedule("broken_sched", num_ranks=2, num_microbatches=4, plugins=plugins)
