"""What the benchmarks share, so that each script in bench/ holds only its experiment: launching ranks (launch),
their command-line flags (cli), the methods they compare (methods), the training loop's pieces (train), the JSON
record and the plots (report), the gradients to select from (gradients), the timed selection step (selection) and
the collectives' bytes on the wire (traffic)."""
