package cli

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"
)

// dockerOnly are docker run flags that tandem run does not have, each with
// what to use instead. An unknown flag that is not here is refused as
// unknown, with where the list is.
var dockerOnly = map[string]string{
	"publish-all":  "tandem publishes only the ports you name: give each with -p HOST_PORT:CONTAINER_PORT",
	"P":            "", // as publish-all
	"cap-add":      "the shim's protocol has no capabilities: --privileged gives the job all of them and every device",
	"cap-drop":     "", // as cap-add
	"device":       "", // as cap-add
	"security-opt": "", // as cap-add
	"env-file":     "give each variable with -e KEY=VALUE (or -e KEY for this machine's value)",
	"restart":      "a job runs once: run it again",
	"label":        "the shim's protocol has no labels: --name names the task",
	"l":            "", // as label
	"hostname":     "the shim's protocol has no hostname: with --network host the job has the host's",
	"add-host":     "the shim's protocol has no DNS settings: with --network host the job has the host's",
	"dns":          "", // as add-host
	"dns-search":   "", // as add-host
	"dns-option":   "", // as add-host
	"ipc":          "the shim's protocol has no namespace settings (a GPU task gets the host's IPC where its vendor needs it)",
	"pid":          "", // as ipc
	"uts":          "", // as ipc
	"userns":       "", // as ipc
	"tmpfs":        "the shim's protocol has no tmpfs mounts: --shm-size sizes /dev/shm",
	"platform":     "the shim pulls the host's platform of the image",
	"pull":         "the shim pulls an image whose tag is latest or that it does not have",
	"ulimit":       "the shim's protocol has no ulimits: --pids-limit bounds processes",
	"attach":       "the job's output is always shown (or -d: none)",
	"a":            "", // as attach
	"sig-proxy":    "Ctrl-C stops the job gracefully, a second kills it",
	"init":         "the runner is the container's init",
	"read-only":    "the shim's protocol has no read-only root",
	"cidfile":      "-d prints the task's name and id",
	"runtime":      "the shim picks the runtime for the task's GPUs",
	"log-driver":   "the runner keeps the job's output (tandem logs)",
	"log-opt":      "", // as log-driver
	"volumes-from": "give each mount with -v",
	"link":         "the shim's protocol has no links: --network host shares the host's",
}

// dockerOnlyAs is the flag whose advice a flag of dockerOnly shares.
var dockerOnlyAs = map[string]string{"P": "publish-all", "cap-drop": "cap-add", "device": "cap-add",
	"security-opt": "cap-add", "l": "label", "dns": "add-host", "dns-search": "add-host", "dns-option": "add-host", "pid": "ipc", "uts": "ipc",
	"userns": "ipc", "a": "attach", "log-opt": "log-driver"}

// dockerArgs rewrites the command line of tandem run and tandem exec as a
// docker user types it, before urfave parses it: grouped short flags (-it,
// -dit) become one each; -i followed by a private key file is the SSH
// identity, as it was spelt before -i meant docker's (said deprecated on
// warn); a docker flag tandem does not have, or any unknown flag, is an
// error that says what to use instead (urfave's is "flag provided but not
// defined: -rm", shown with one dash whatever was typed). Only the flags
// before the first argument are looked at: the job's own come after.
func dockerArgs(app *cli.App, argv []string, warn io.Writer) ([]string, error) {
	if len(argv) < 2 {
		return argv, nil
	}
	var cmd *cli.Command
	for _, c := range app.Commands {
		if c.Name == argv[1] && (c.Name == "run" || c.Name == "exec") {
			cmd = c
		}
	}
	if cmd == nil {
		return argv, nil
	}
	bools, values := map[string]bool{}, map[string]bool{}
	for _, f := range cmd.Flags {
		_, isBool := f.(*cli.BoolFlag)
		for _, n := range f.Names() {
			if isBool {
				bools[n] = true
			} else {
				values[n] = true
			}
		}
	}
	bools["help"], bools["h"] = true, true
	out := slices.Clone(argv[:2])
	args := argv[2:]
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" || a == "-" || !strings.HasPrefix(a, "-") {
			return append(out, args[i:]...), nil
		}
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		switch {
		case name == "i" && !hasValue:
			if i+1 < len(args) && isPrivateKey(args[i+1]) {
				fmt.Fprintf(warn, "tandem: warning: -i %s as the SSH key is deprecated (-i is docker's --interactive now): use --identity %s\n", args[i+1], args[i+1])
				out = append(out, "--identity", args[i+1])
				i++
				continue
			}
			out = append(out, "--interactive")
		case values[name]:
			out = append(out, a)
			if !hasValue && i+1 < len(args) {
				out = append(out, args[i+1])
				i++
			}
		case bools[name]:
			out = append(out, a)
		case !strings.HasPrefix(a, "--") && len(name) > 1 && !hasValue && allBools(name, bools):
			// -it, -dit: each letter a flag, as docker reads them.
			for _, r := range name {
				if r == 'i' {
					out = append(out, "--interactive")
				} else {
					out = append(out, "-"+string(r))
				}
			}
		default:
			return nil, unknownFlag(cmd.Name, name)
		}
	}
	return out, nil
}

// allBools says whether every letter of s is a one-letter bool flag (or -i).
func allBools(s string, bools map[string]bool) bool {
	for _, r := range s {
		if r != 'i' && !bools[string(r)] {
			return false
		}
	}
	return true
}

// unknownFlag is the refusal of a flag cmd does not have, with docker's
// meaning of it said where tandem has another way.
func unknownFlag(cmd, name string) error {
	dashes := "--"
	if len(name) == 1 {
		dashes = "-"
	}
	advice, known := dockerOnly[name]
	if as := dockerOnlyAs[name]; as != "" {
		advice = dockerOnly[as]
	}
	if known && advice != "" {
		return exitError{125, fmt.Sprintf("tandem %s has no %s%s (docker's): %s", cmd, dashes, name, advice)}
	}
	return exitError{125, fmt.Sprintf("tandem %s has no flag %s%s (tandem %s --help lists them)", cmd, dashes, name, cmd)}
}

// isPrivateKey says whether path is a readable file that holds a private
// key (OpenSSH's or PEM's), as an SSH identity given with the old -i.
func isPrivateKey(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return false
	}
	head := make([]byte, 64)
	n, _ := io.ReadFull(f, head)
	return bytes.HasPrefix(head[:n], []byte("-----BEGIN ")) && bytes.Contains(head[:n], []byte("PRIVATE KEY"))
}
