#!/bin/bash
python3 -c "import json; json.dump({'words': len(open('corpus.txt').read().split())}, open('count.json', 'w'))"
