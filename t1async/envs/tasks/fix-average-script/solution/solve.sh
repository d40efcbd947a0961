#!/bin/bash
cat > /app/average.py <<'PY'
import sys


def read_numbers(path):
    numbers = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                numbers.append(float(line))
    return numbers


def average(numbers):
    return sum(numbers) / len(numbers)


def main():
    numbers = read_numbers(sys.argv[1])
    if not numbers:
        print("average: n/a")
    else:
        print(f"average: {average(numbers):.2f}")


if __name__ == "__main__":
    main()
PY
