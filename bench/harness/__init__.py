"""What the benchmarks share, so that each script in bench/ holds only its experiment: launching ranks (launch),
their command-line flags (cli), the methods they compare (methods), the DDP training loop's pieces (train), the
JSON record and the plots (report), and the gradients to select from (gradients)."""
