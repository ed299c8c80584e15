"""`--dist loadscope` that survives a worker's crash (a pytest plugin; conftest loads it).

pytest-xdist 3.8's `LoadScopeScheduling` can hang the whole run once a worker dies (a segfault, an
OOM kill): `remove_node` puts every scope the dead worker ever ran back on the queue, finished
ones included, and a finished scope handed to a worker is an empty `runtests` that never reports
back, so nothing is scheduled again; a replacement worker can also be given a scope of a single
test, and a worker holding one test waits for a next one that never comes (pytest-xdist issues
1323, 1327 and 1378). This scheduler requeues only the dead worker's unfinished scopes, without
the test it died on (xdist has already reported that one as failed), and keeps at least two
tests on every worker while work is left.
"""

from xdist.scheduler import LoadScopeScheduling


class CrashSafeLoadScope(LoadScopeScheduling):
    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        crash_unit = next(iter(unfinished.values()))
        crash_item = next(nodeid for nodeid, done in crash_unit.items() if not done)
        crash_unit[crash_item] = True
        for scope, unit in unfinished.items():
            if not all(unit.values()):
                self.workqueue[scope] = unit
        for other in self.assigned_work:
            self._reschedule(other)
        return crash_item

    def _reschedule(self, node):
        if node.shutting_down or node not in self.registered_collections:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)
        while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadscope":
        return CrashSafeLoadScope(config, log)
    return None
