package cli

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/ctl"
)

func waitCmd() *cli.Command {
	return &cli.Command{Name: "wait", Usage: "wait for tasks' jobs to end and print each one's exit code (as tandem run would exit)",
		ArgsUsage:    "TASK... (names, ids or id prefixes)",
		Flags:        append(connFlags(), runnerPortFlag),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() == 0 {
				return exitError{ctl.ExitFailure, "usage: tandem wait TASK..."}
			}
			ctx, cl, done, err := interruptible(c, nil)
			if err != nil {
				return err
			}
			defer done()
			// In the order given, each code as its job ends, as docker
			// wait prints them.
			for _, ref := range c.Args().Slice() {
				res, err := cl.Wait(ctx, ref)
				if ctx.Err() != nil {
					return exitError{ctl.ExitInterrupted, ""}
				}
				if err != nil {
					return exitError{ctl.ExitFailure, errText(err)}
				}
				fmt.Fprintln(c.App.Writer, res.ExitCode())
			}
			return nil
		}}
}
