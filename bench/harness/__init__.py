"""What the benchmarks share, so that each script in bench/ holds only its experiment."""
