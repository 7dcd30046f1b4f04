// Command benchtable turns `make bench` output into the figures table of
// docs/figures.md: every figure that has a target, its verdict, and every
// metric of every benchmark, dated and with the machine named. It rewrites
// what lies between the doc's markers and nothing else.
//
//	go run ./internal/benchtable -log bench.log -doc docs/figures.md
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	logPath := flag.String("log", "bench.log", "make bench's output")
	doc := flag.String("doc", "docs/figures.md", "the file whose marked section is rewritten")
	flag.Parse()
	if err := run(*logPath, *doc); err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
}

// run dates the table by when the log was last written: when the bench
// finished, not when the table was made again from it.
func run(logPath, doc string) error {
	f, err := os.Open(logPath)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	now := st.ModTime()
	rep, err := Parse(f)
	if err != nil {
		return fmt.Errorf("%s: %w", logPath, err)
	}
	old, err := os.ReadFile(doc)
	if err != nil {
		return err
	}
	out, err := Replace(string(old), Render(rep, now))
	if err != nil {
		return fmt.Errorf("%s: %w", doc, err)
	}
	if err := writeKeepingMode(doc, []byte(out)); err != nil {
		return err
	}
	fmt.Printf("benchtable: %s: %d figures with targets (%d missed), %d benchmarks\n", doc, len(rep.Targets), rep.Missed(), len(rep.Benchmarks))
	return nil
}

func writeKeepingMode(path string, b []byte) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	tmp := path + ".benchtable.tmp"
	if err := os.WriteFile(tmp, b, fi.Mode().Perm()); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
