"""Worker runs made the first time a test asks for them (module fixtures hold one LazyRuns).

In: a function name -> result that runs one layout's torchrun worker. Out: a dict that calls it
on first access of a name, so a slow-marked layout runs only when one of its tests is selected.
"""


class LazyRuns(dict):
    def __init__(self, run, **ready):
        super().__init__(**ready)
        self._run = run

    def __missing__(self, name):
        self[name] = self._run(name)
        return self[name]
