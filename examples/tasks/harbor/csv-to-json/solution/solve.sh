#!/bin/bash
python3 -c '
import csv, json
rows = [dict(r, age=int(r["age"])) for r in csv.DictReader(open("/app/people.csv"))]
json.dump(rows, open("/app/people.json", "w"))
'
