package cli

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// TestREADMECommandsExist: every `bin/tandem ...` line of the README's
// shell blocks names a real command, and every flag it shows is one of
// that command's (or a global one): the README cannot promise a command
// line the binary refuses.
func TestREADMECommandsExist(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	app := App()
	checked := 0
	inBlock := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "```") {
			inBlock = !inBlock
			continue
		}
		if !inBlock || !strings.HasPrefix(line, "bin/tandem ") {
			continue
		}
		line, _, _ = strings.Cut(line, "#") // a comment
		rest := strings.TrimPrefix(line, "bin/tandem ")
		// "ps [-a] | attach NAME | logs [-f] ...": one command each.
		for _, alt := range strings.Split(rest, " | ") {
			fields := strings.Fields(alt)
			if len(fields) == 0 {
				continue
			}
			name := fields[0]
			cmd := app.Command(name)
			if cmd == nil {
				t.Errorf("README: %q is not a tandem command (line %q)", name, line)
				continue
			}
			toks := fields[1:]
			if len(toks) > 0 && len(cmd.Subcommands) > 0 {
				if sub := cmd.Command(toks[0]); sub != nil {
					cmd, name, toks = sub, name+" "+toks[0], toks[1:]
				}
			}
			// Flags as urfave reads them: up to the first argument that is
			// not a flag or a flag's value (after it, the job's command).
			for i := 0; i < len(toks); i++ {
				tok := strings.Trim(toks[i], "[]")
				if tok == "--" || !strings.HasPrefix(tok, "-") {
					break
				}
				flag, _, hasValue := strings.Cut(strings.TrimLeft(tok, "-"), "=")
				f := findFlag(cmd, flag)
				if f == nil {
					t.Errorf("README: tandem %s has no flag %s (line %q)", name, tok, line)
					continue
				}
				if _, isBool := f.(*cli.BoolFlag); !isBool && !hasValue {
					i++ // its value
				}
			}
			checked++
		}
	}
	if checked < 8 {
		t.Fatalf("only %d README command lines found", checked)
	}
}

func findFlag(cmd *cli.Command, name string) cli.Flag {
	for _, f := range cmd.Flags {
		if slices.Contains(f.Names(), name) {
			return f
		}
	}
	return nil
}
