"""`make mutation`'s mutmut, walking the package as it is imported.

The folders workers/, schemas/, topology/ and infra/ are the subpackages of `dgstream`
through links (dgstream/workers -> ../workers). mutmut 3.8 names a mutant by its file's path
and finds the files by walking its `source_paths` without following links, so walked from
the folders its mutants would be `workers.x...` while the tests import `dgstream.workers.x`,
and no mutant would ever run. Walked from dgstream/ with the links followed, each file's path
is its import name, mutmut's copy (mutants/dgstream/) holds real files, and the tests import
the mutated copy.

    python -m bench.mutmut_run run --max-children 1    # mutmut's own arguments
"""

from __future__ import annotations

import functools
import os
import sys


def main() -> int:
    import mutmut.utils.file_utils as file_utils
    from mutmut.__main__ import cli

    # mutmut's one walk over the source (`from os import walk` in that module).
    file_utils.walk = functools.partial(os.walk, followlinks=True)  # type: ignore[attr-defined]
    return cli(sys.argv[1:], standalone_mode=False) or 0


if __name__ == "__main__":
    raise SystemExit(main())
