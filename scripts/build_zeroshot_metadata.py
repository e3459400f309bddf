"""Regenerate cloob_core/evaluation/classnames/*.json: class names and prompt templates of the CLOOB paper's
zero-shot data sets, as facts carried over from their published sources.

Sources: CLIP_benchmark's `en_classnames.json` and `en_zeroshot_classification_templates.json` (MIT licence;
the wheel is fetched with `pip download`), open_clip's ImageNet class names and OpenAI templates (MIT), and, for
sets CLIP_benchmark has no names for, the lists of OpenAI CLIP's `data/prompts.md` (MIT) written out below and
in scripts/clip_prompt_lists.json.
Class order is the data sets' label order as those sources give it. Each file records its source. Run from the
repository root:

    .venv/bin/python scripts/build_zeroshot_metadata.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "cloob_core" / "evaluation" / "classnames"
# paper name -> CLIP_benchmark key (None: not in CLIP_benchmark)
PAPER_SETS = {
    "birdsnap": None, "country211": "country211", "flowers102": "flowers", "gtsrb": "gtsrb", "ucf101": None,
    "stanford_cars": "cars", "imagenet": "imagenet1k", "imagenet_v2": "imagenet1k", "caltech101": "caltech101",
    "cifar10": "cifar10", "cifar100": "cifar100", "dtd": "dtd", "eurosat": "eurosat", "fer2013": "fer2013",
    "fgvc_aircraft": "fgvc_aircraft", "food101": "food101", "pets": "pets", "resisc45": "resisc45", "stl10": "stl10",
    "sun397": "sun397",
}
KNOWN_SOURCES = {name: "OpenAI CLIP data/prompts.md (MIT)" for name in ("food101", "fgvc_aircraft", "cifar100")}
KNOWN_CLASSES = {  # the data sets' own label lists
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
    "stl10": ["airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck"],
    # CIFAR-100's fine labels, underscores as spaces (as CLIP prompts them)
    "cifar100": [
        "apple", "aquarium fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
        "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee",
        "clock", "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant",
        "flatfish", "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn mower",
        "leopard", "lion", "lizard", "lobster", "man", "maple tree", "motorcycle", "mountain", "mouse", "mushroom",
        "oak tree", "orange", "orchid", "otter", "palm tree", "pear", "pickup truck", "pine tree", "plain", "plate",
        "poppy", "porcupine", "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark",
        "shrew", "skunk", "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower",
        "sweet pepper", "table", "tank", "telephone", "television", "tiger", "tractor", "train", "trout", "tulip",
        "turtle", "wardrobe", "whale", "willow tree", "wolf", "woman", "worm",
    ],
    # Food-101, as CLIP's data/prompts.md lists them (underscores as spaces)
    "food101": [
        "apple pie", "baby back ribs", "baklava", "beef carpaccio", "beef tartare", "beet salad", "beignets",
        "bibimbap", "bread pudding", "breakfast burrito", "bruschetta", "caesar salad", "cannoli", "caprese salad",
        "carrot cake", "ceviche", "cheese plate", "cheesecake", "chicken curry", "chicken quesadilla",
        "chicken wings", "chocolate cake", "chocolate mousse", "churros", "clam chowder", "club sandwich",
        "crab cakes", "creme brulee", "croque madame", "cup cakes", "deviled eggs", "donuts", "dumplings", "edamame",
        "eggs benedict", "escargots", "falafel", "filet mignon", "fish and chips", "foie gras", "french fries",
        "french onion soup", "french toast", "fried calamari", "fried rice", "frozen yogurt", "garlic bread",
        "gnocchi", "greek salad", "grilled cheese sandwich", "grilled salmon", "guacamole", "gyoza", "hamburger",
        "hot and sour soup", "hot dog", "huevos rancheros", "hummus", "ice cream", "lasagna", "lobster bisque",
        "lobster roll sandwich", "macaroni and cheese", "macarons", "miso soup", "mussels", "nachos", "omelette",
        "onion rings", "oysters", "pad thai", "paella", "pancakes", "panna cotta", "peking duck", "pho", "pizza",
        "pork chop", "poutine", "prime rib", "pulled pork sandwich", "ramen", "ravioli", "red velvet cake", "risotto",
        "samosa", "sashimi", "scallops", "seaweed salad", "shrimp and grits", "spaghetti bolognese",
        "spaghetti carbonara", "spring rolls", "steak", "strawberry shortcake", "sushi", "tacos", "takoyaki",
        "tiramisu", "tuna tartare", "waffles",
    ],
    # FGVC-Aircraft variants, as CLIP's data/prompts.md lists them
    "fgvc_aircraft": [
        "707-320", "727-200", "737-200", "737-300", "737-400", "737-500", "737-600", "737-700", "737-800", "737-900",
        "747-100", "747-200", "747-300", "747-400", "757-200", "757-300", "767-200", "767-300", "767-400", "777-200",
        "777-300", "A300B4", "A310", "A318", "A319", "A320", "A321", "A330-200", "A330-300", "A340-200", "A340-300",
        "A340-500", "A340-600", "A380", "ATR-42", "ATR-72", "An-12", "BAE 146-200", "BAE 146-300", "BAE-125",
        "Beechcraft 1900", "Boeing 717", "C-130", "C-47", "CRJ-200", "CRJ-700", "CRJ-900", "Cessna 172", "Cessna 208",
        "Cessna 525", "Cessna 560", "Challenger 600", "DC-10", "DC-3", "DC-6", "DC-8", "DC-9-30", "DH-82", "DHC-1",
        "DHC-6", "DHC-8-100", "DHC-8-300", "DR-400", "Dornier 328", "E-170", "E-190", "E-195", "EMB-120", "ERJ 135",
        "ERJ 145", "Embraer Legacy 600", "Eurofighter Typhoon", "F-16A/B", "F/A-18", "Falcon 2000", "Falcon 900",
        "Fokker 100", "Fokker 50", "Fokker 70", "Global Express", "Gulfstream IV", "Gulfstream V", "Hawk T1", "Il-76",
        "L-1011", "MD-11", "MD-80", "MD-87", "MD-90", "Metroliner", "Model B200", "PA-28", "SR-20", "Saab 2000",
        "Saab 340", "Spitfire", "Tornado", "Tu-134", "Tu-154", "Yak-42",
    ],
    # DTD's 47 texture categories
    "dtd": [
        "banded", "blotchy", "braided", "bubbly", "bumpy", "chequered", "cobwebbed", "cracked", "crosshatched",
        "crystalline", "dotted", "fibrous", "flecked", "freckled", "frilly", "gauzy", "grid", "grooved", "honeycombed",
        "interlaced", "knitted", "lacelike", "lined", "marbled", "matted", "meshed", "paisley", "perforated", "pitted",
        "pleated", "polka-dotted", "porous", "potholed", "scaly", "smeared", "spiralled", "sprinkled", "stained",
        "stratified", "striped", "studded", "swirly", "veined", "waffled", "woven", "wrinkled", "zigzagged",
    ],
}


def clip_benchmark_json() -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "clip_benchmark==1.6.2",
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            names = json.loads(archive.read("clip_benchmark/datasets/en_classnames.json"))
            templates = json.loads(archive.read("clip_benchmark/datasets/en_zeroshot_classification_templates.json"))
    return names, templates


def main() -> None:
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    names, templates = clip_benchmark_json()
    clip_lists = json.loads((Path(__file__).parent / "clip_prompt_lists.json").read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    index = {}
    for dataset, key in PAPER_SETS.items():
        entry: dict = {"dataset": dataset, "sources": []}
        if dataset in ("imagenet", "imagenet_v2"):
            entry["classnames"] = list(IMAGENET_CLASSNAMES)
            entry["templates"] = [t("{c}") for t in OPENAI_IMAGENET_TEMPLATES]
            entry["sources"].append("open_clip zero_shot_metadata (MIT): IMAGENET_CLASSNAMES, "
                                    "OPENAI_IMAGENET_TEMPLATES")
        else:
            if key in names:
                entry["classnames"] = names[key]
                entry["sources"].append("CLIP_benchmark 1.6.2 en_classnames.json (MIT)")
            elif dataset in KNOWN_CLASSES:
                entry["classnames"] = KNOWN_CLASSES[dataset]
                entry["sources"].append(KNOWN_SOURCES.get(dataset, f"{dataset} label list"))
            elif "classnames" in clip_lists.get(dataset, {}):
                entry["classnames"] = clip_lists[dataset]["classnames"]
                entry["sources"].append("OpenAI CLIP data/prompts.md (MIT), via scripts/clip_prompt_lists.json")
            if key in templates:
                entry["templates"] = templates[key]
                entry["sources"].append("CLIP_benchmark 1.6.2 en_zeroshot_classification_templates.json (MIT)")
            elif "templates" in clip_lists.get(dataset, {}):
                entry["templates"] = clip_lists[dataset]["templates"]
                entry["sources"].append("OpenAI CLIP data/prompts.md (MIT), via scripts/clip_prompt_lists.json")
        index[dataset] = {"classnames": len(entry.get("classnames", [])), "templates": len(entry.get("templates", []))}
        if "classnames" in entry or "templates" in entry:
            (OUT / f"{dataset}.json").write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(index, indent=1))


if __name__ == "__main__":
    main()
