package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

func statsCmd() *cli.Command {
	return &cli.Command{Name: "stats", Usage: "show running tasks' CPU, memory and GPU use, refreshed (--no-stream: once)",
		ArgsUsage: "[TASK...] (names, ids or id prefixes; default: every running task)",
		Flags: append(connFlags(), runnerPortFlag, outputFlag,
			&cli.BoolFlag{Name: "no-stream", Usage: "print one table and exit (CPU use over --interval)"},
			&cli.DurationFlag{Name: "interval", Value: 2 * time.Second, Usage: "time between samples (CPU use is over it)"}),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			interval := c.Duration("interval")
			if interval < 100*time.Millisecond {
				return exitError{ctl.ExitFailure, fmt.Sprintf("--interval %s: want 100ms or more", interval)}
			}
			ctx, cl, done, err := interruptible(c, nil)
			if err != nil {
				return err
			}
			defer done()
			s := cl.NewSampler(c.Args().Slice())
			screen := false
			if isTerminal(c.App.Writer) && !c.Bool("no-stream") && c.String("output") == "text" {
				screen = true
			}
			for round := 0; ; round++ {
				stats, err := s.Sample(ctx)
				if err != nil {
					if ctx.Err() != nil {
						return nil // Ctrl-C ends the stats
					}
					return exitError{ctl.ExitFailure, errText(err)}
				}
				// The first sample has no CPU figure: the table comes with
				// the second.
				if round > 0 {
					if err := printStats(c, stats, screen, round > 1); err != nil {
						return err
					}
					if c.Bool("no-stream") {
						for _, st := range stats {
							if st.Error != "" {
								fmt.Fprintf(c.App.ErrWriter, "tandem: %s: %s\n", api.Printable(statName(st)), api.Printable(st.Error))
							}
						}
						return nil
					}
				}
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(interval):
				}
			}
		}}
}

// printStats writes one table (or one JSON array per sample); on a
// terminal each table replaces the one before.
func printStats(c *cli.Context, stats []ctl.Stat, screen, again bool) error {
	if c.String("output") == "json" {
		return writeJSON(c, stats)
	}
	w := c.App.Writer
	switch {
	case screen:
		fmt.Fprint(w, "\x1b[H\x1b[2J") // home, clear: the table redrawn in place
	case again:
		fmt.Fprintln(w)
	}
	return statsTable(w, stats)
}

func statsTable(out io.Writer, stats []ctl.Stat) error {
	w := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tID\tCPU %\tMEM USAGE / LIMIT\tMEM %\tGPU UTIL\tGPU MEM")
	for _, st := range stats {
		cpu, mem, memPct, gpuUtil, gpuMem := "-", "-", "-", "-", "-"
		if st.Error == "" {
			if st.CPUPercent != nil {
				cpu = fmt.Sprintf("%.1f%%", *st.CPUPercent)
			}
			limit := "-"
			if st.MemoryLimit > 0 {
				limit = ctl.BytesText(uint64(st.MemoryLimit))
				memPct = fmt.Sprintf("%.1f%%", float64(st.MemoryBytes)/float64(st.MemoryLimit)*100)
			}
			mem = ctl.BytesText(st.MemoryBytes) + " / " + limit
			if len(st.GPUs) > 0 {
				utils := make([]string, len(st.GPUs))
				var used uint64
				for i, g := range st.GPUs {
					utils[i] = fmt.Sprintf("%d%%", g.GPUUtilPercent)
					used += g.GPUMemoryUsageBytes
				}
				gpuUtil, gpuMem = strings.Join(utils, ","), ctl.BytesText(used)
			}
		}
		// Names and ids are the shim's: escaped.
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", dash(api.Printable(st.Name)),
			api.Printable(ctl.ShortID(st.ID)), cpu, mem, memPct, gpuUtil, gpuMem)
	}
	return w.Flush()
}

func statName(st ctl.Stat) string {
	if st.Name != "" {
		return st.Name
	}
	return ctl.ShortID(st.ID)
}
