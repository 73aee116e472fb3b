"""Regenerates bundled.jsonl (`python -m jaxtrain.corpus.generate`, deterministic): synthetic documents
of varied length with enough structure that a tiny model's loss falls. Not used by the library."""

import json
import random
from pathlib import Path

TOWNS = ["Alder", "Brook", "Cairn", "Dunmore", "Elmstead", "Fallow", "Garnet", "Harrow", "Ivybridge",
         "Juniper", "Kestrel", "Larkspur", "Marsh", "Northgate", "Oakham", "Pell", "Quarry", "Rowan"]
TRADES = ["weavers", "millers", "potters", "smiths", "fishers", "bakers", "masons", "carpenters"]
GOODS = {"weavers": "cloth", "millers": "flour", "potters": "jars", "smiths": "nails", "fishers": "herring",
         "bakers": "bread", "masons": "stone", "carpenters": "chairs"}
RIVERS = ["the Wend", "the Tarrow", "the Mole", "the Brisk", "the Sallow"]
SEASONS = ["spring", "summer", "autumn", "winter"]
ANIMALS = ["fox", "heron", "badger", "otter", "owl", "hare", "wren", "stoat"]
VERBS = ["watched", "followed", "found", "called to", "waited for", "ran from"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def town(r: random.Random) -> str:
  name, trade, river, season = r.choice(TOWNS), r.choice(TRADES), r.choice(RIVERS), r.choice(SEASONS)
  lines = [f"{name} is a town on {river}. About {r.randrange(200, 9000, 50)} people live there.",
           f"Most of the town are {trade}, and in {season} they sell {GOODS[trade]} at the market."]
  for _ in range(r.randrange(0, 6)):
    other = r.choice(TRADES)
    lines.append(f"There are also {other} in {name}; the {other} make {GOODS[other]}.")
  lines.append(f"The road from {name} to {r.choice(TOWNS)} takes {NUMBERS[r.randrange(1, 11)]} days on foot.")
  return " ".join(lines)


def story(r: random.Random) -> str:
  a, b = r.sample(ANIMALS, 2)
  parts = [f"Once a {a} lived near {r.choice(RIVERS)}."]
  for _ in range(r.randrange(2, 14)):
    parts.append(f"The {a} {r.choice(VERBS)} the {b} in the {r.choice(SEASONS)} rain.")
    if r.random() < 0.3:
      a, b = b, a
  parts.append(f"And that is why the {a} and the {b} are never seen together.")
  return " ".join(parts)


def counting(r: random.Random) -> str:
  start, step = r.randrange(0, 50), r.randrange(1, 6)
  seq = ", ".join(str(start + i * step) for i in range(r.randrange(5, 40)))
  return f"Counting by {step} from {start}: {seq}."


def arithmetic(r: random.Random) -> str:
  pairs = [(r.randrange(0, 100), r.randrange(0, 100)) for _ in range(r.randrange(1, 12))]
  return " ".join(f"{x} + {y} = {x + y}." for x, y in pairs)


def main(n_docs: int = 2000, seed: int = 1234, out: Path | None = None) -> None:
  r, kinds = random.Random(seed), [town, story, counting, arithmetic]
  out = out or Path(__file__).with_name("bundled.jsonl")
  with out.open("w") as f:
    for i in range(n_docs):
      text = "\n\n".join(r.choice(kinds)(r) for _ in range(r.choice([1, 1, 1, 2, 3])))
      f.write(json.dumps({"id": i, "text": text}) + "\n")
  print(f"wrote {n_docs} documents to {out}")


if __name__ == "__main__":
  main()
