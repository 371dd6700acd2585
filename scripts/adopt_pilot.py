"""Install finished pilot arms (scripts/pilot_lookups.py) as the next continuation stages of a
recipe, in order, when each ran that stage's recipe from the previous stage's weights
(`replaykv.train.continuation.adopt_run` checks both):

    python scripts/adopt_pilot.py --out ~/.cache/replaykv/train/v41-small \\
        ~/.cache/replaykv/pilot/lower_repeat/lr0.0005 ~/.cache/replaykv/pilot/lower_chains/lr0.0005

Each arm's starting weights are the `stage` argument its pilot.json records. Then `replaykv
train --recipe small --out OUT --resume` continues after the last one, and `--bar` scores it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from replaykv.train.continuation import adopt_run
from replaykv.train.recipes import get_recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arms", nargs="+", help="pilot arm directories (OUT/lr...), in stage order")
    p.add_argument("--out", required=True, help="the recipe's training directory (OUT/stage/ is written)")
    p.add_argument("--recipe", default="small")
    args = p.parse_args()
    recipe = get_recipe(args.recipe)
    for arm in map(Path, args.arms):
        pilot = json.loads((arm.parent / "pilot.json").read_text())
        record = adopt_run(recipe, args.out, arm, pilot["stage"])
        print(f"stage {record['stage']} ({record['continuation']}): {arm}, step {record['step']:,}")


if __name__ == "__main__":
    main()
