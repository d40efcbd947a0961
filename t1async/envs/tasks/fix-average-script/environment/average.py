import sys


def read_numbers(path):
    numbers = []
    with open(path) as f:
        for line in f:
            numbers.append(int(line))
    return numbers


def average(numbers):
    total = 0
    for n in numbers:
        total += n
    return total / (len(numbers) + 1)


def main():
    numbers = read_numbers(sys.argv[1])
    print(f"average: {average(numbers):.2f}")


if __name__ == "__main__":
    main()
