package cli

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/ctl"
)

// completeTasks completes task names (and short ids) from the shim.
func completeTasks(c *cli.Context) {
	for _, r := range taskRefs(c) {
		fmt.Fprintln(c.App.Writer, r)
	}
}

const bashCompletion = `# tandem bash completion: source <(tandem completion bash)
_tandem_complete() {
	local cur="${COMP_WORDS[COMP_CWORD]}"
	local opts
	opts=$("${COMP_WORDS[0]}" "${COMP_WORDS[@]:1:$COMP_CWORD-1}" --generate-bash-completion 2>/dev/null)
	COMPREPLY=($(compgen -W "${opts}" -- "${cur}"))
	return 0
}
complete -o default -F _tandem_complete tandem
`

const zshCompletion = `#compdef tandem
# tandem zsh completion: source <(tandem completion zsh)
_tandem() {
	local -a opts
	opts=("${(@f)$(${words[1]} ${words[@]:1:$((CURRENT-2))} --generate-bash-completion 2>/dev/null)}")
	_describe 'values' opts
}
compdef _tandem tandem
`

func completionCmd() *cli.Command {
	return &cli.Command{Name: "completion", Usage: "print a shell completion script: bash, zsh or fish",
		ArgsUsage: "bash|zsh|fish",
		Description: "bash: source <(tandem completion bash)   zsh: source <(tandem completion zsh)\n" +
			"fish: tandem completion fish > ~/.config/fish/completions/tandem.fish",
		Action: func(c *cli.Context) error {
			switch c.Args().First() {
			case "bash":
				_, err := fmt.Fprint(c.App.Writer, bashCompletion)
				return err
			case "zsh":
				_, err := fmt.Fprint(c.App.Writer, zshCompletion)
				return err
			case "fish":
				s, err := c.App.ToFishCompletion()
				if err != nil {
					return exitError{ctl.ExitFailure, errText(err)}
				}
				_, err = fmt.Fprint(c.App.Writer, s)
				return err
			}
			return exitError{ctl.ExitFailure, "usage: tandem completion bash|zsh|fish"}
		}}
}
