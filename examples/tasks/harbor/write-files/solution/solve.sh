#!/bin/bash
printf apple > /app/a.txt
printf river > /app/data.txt
printf piano > /app/note.txt
