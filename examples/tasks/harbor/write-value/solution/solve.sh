#!/bin/bash
printf river > /app/value.txt
