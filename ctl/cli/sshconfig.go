package cli

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/atomicfile"
	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/ctl"
)

// sshConfigPath is tandem's own ssh config file, which ~/.ssh/config
// includes (tandem ssh-config --install adds the Include line).
func sshConfigPath() (string, error) {
	if p := os.Getenv("TANDEM_SSH_CONFIG"); p != "" {
		return p, nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("no home directory: %w", err)
	}
	return filepath.Join(home, ".tandem", "ssh_config"), nil
}

// editSSHConfig rewrites tandem's ssh config under an exclusive lock:
// edit gets the entries (blocks starting at a "# tandem task" marker) and
// returns the new ones. The file is replaced atomically, mode 0600.
func editSSHConfig(edit func(entries []string) []string) (string, error) {
	path, err := sshConfigPath()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(path+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", err
	}
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return "", err
	}
	var entries []string
	for _, block := range strings.SplitAfter(string(old), "\n\n") {
		if strings.HasPrefix(block, "# tandem task ") {
			entries = append(entries, strings.TrimRight(block, "\n")+"\n")
		}
	}
	var b bytes.Buffer
	b.WriteString("# Written by tandem: one Host per task (tandem ssh-config). Edits are lost.\n\n")
	for _, e := range edit(entries) {
		b.WriteString(e)
		b.WriteString("\n")
	}
	return path, atomicfile.WriteBytes(path, b.Bytes(), atomicfile.Options{Perm: 0o600, UID: -1})
}

// entryTask returns the task id and shim of an entry's marker.
func entryTask(entry string) (id, shim string) {
	line, _, _ := strings.Cut(entry, "\n")
	f := strings.Fields(line) // # tandem task ID shim ADDR
	if len(f) >= 6 {
		return f[3], f[5]
	}
	return "", ""
}

func sshEndpoint(c *cli.Context, shim, jump string, info api.TaskInfoResponse) (ctl.SSHEndpoint, error) {
	identity := c.String("identity")
	if identity == "" {
		if _, pub := ctl.DefaultPublicKey(""); pub != "" {
			identity = strings.TrimSuffix(pub, ".pub")
		}
	}
	return ctl.Endpoint(info, ctl.SSHOptions{Shim: shim, Jump: jump, Identity: identity,
		KnownHosts: c.String("known-hosts"), RunnerSSHPort: c.Int("runner-ssh-port")})
}

// alias is the task's Host name: its name when it is a valid task name,
// else tandem-<short id>.
func alias(info api.TaskInfoResponse) string {
	if n := ctl.TaskName(info); ident.TaskName(n) == nil {
		return n
	}
	return "tandem-" + ctl.ShortID(info.ID)
}

// updateSSHConfig adds (or refreshes) the task's entry.
func updateSSHConfig(c *cli.Context, shim, jump string, info api.TaskInfoResponse) error {
	ep, err := sshEndpoint(c, shim, jump, info)
	if err != nil {
		return err
	}
	entry, err := ctl.SSHConfigEntry(alias(info), info.ID, shim, ep)
	if err != nil {
		return err
	}
	_, err = editSSHConfig(func(entries []string) []string {
		out := []string{entry}
		for _, e := range entries {
			if id, _ := entryTask(e); id != info.ID && !strings.Contains(e, "\nHost "+alias(info)+"\n") {
				out = append(out, e)
			}
		}
		return out
	})
	return err
}

// forgetSSHConfig drops the task's entry.
func forgetSSHConfig(taskID string) error {
	path, err := sshConfigPath()
	if err != nil {
		return err
	}
	if _, err := os.Stat(path); err != nil {
		return nil
	}
	_, err = editSSHConfig(func(entries []string) []string {
		var out []string
		for _, e := range entries {
			if id, _ := entryTask(e); id != taskID {
				out = append(out, e)
			}
		}
		return out
	})
	return err
}

func sshConfigCmd() *cli.Command {
	return &cli.Command{Name: "ssh-config",
		Usage: "keep an ssh config with one Host per running task (ssh NAME, scp, rsync, VS Code Remote)",
		Description: "Rewrites this shim's entries in ~/.tandem/ssh_config (TANDEM_SSH_CONFIG) from its running tasks;\n" +
			"entries of other shims stay. --install adds `Include ~/.tandem/ssh_config` to ~/.ssh/config once.\n" +
			"tandem run adds its task's entry by default and drops it when the run ends (kept with -d).",
		Flags: append(connFlags(), runnerSSHPortFlag,
			&cli.BoolFlag{Name: "install", Usage: "add the Include line to ~/.ssh/config"},
			&cli.BoolFlag{Name: "print", Usage: "print the file after writing it"}),
		Action: func(c *cli.Context) error {
			infos, err := listTasks(c)
			if err != nil {
				return err
			}
			var fresh []string
			for _, info := range infos {
				if info.Status != api.TaskRunning {
					continue
				}
				ep, err := sshEndpoint(c, c.String("shim"), c.String("ssh"), info)
				var entry string
				if err == nil {
					entry, err = ctl.SSHConfigEntry(alias(info), info.ID, c.String("shim"), ep)
				}
				if err != nil {
					fmt.Fprintln(c.App.ErrWriter, "tandem: skipping", alias(info)+":", err)
					continue
				}
				fresh = append(fresh, entry)
			}
			path, err := editSSHConfig(func(entries []string) []string {
				out := fresh
				for _, e := range entries {
					if _, shim := entryTask(e); shim != c.String("shim") {
						out = append(out, e)
					}
				}
				return out
			})
			if err != nil {
				return exitError{ctl.ExitFailure, "ssh config: " + err.Error()}
			}
			fmt.Fprintf(c.App.ErrWriter, "%s: %d task(s) of %s\n", path, len(fresh), c.String("shim"))
			if c.Bool("install") {
				if err := installInclude(path); err != nil {
					return exitError{ctl.ExitFailure, "~/.ssh/config: " + err.Error()}
				}
			} else if !included(path) {
				fmt.Fprintf(c.App.ErrWriter, "add `Include %s` at the top of ~/.ssh/config (or run tandem ssh-config --install)\n", path)
			}
			if c.Bool("print") {
				b, _ := os.ReadFile(path)
				_, _ = c.App.Writer.Write(b)
			}
			return nil
		}}
}

func userSSHConfig() string {
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".ssh", "config")
}

func included(path string) bool {
	b, err := os.ReadFile(userSSHConfig())
	return err == nil && bytes.Contains(b, []byte("Include "+path))
}

// installInclude puts the Include line first in ~/.ssh/config (an Include
// after a Host block would belong to that block).
func installInclude(path string) error {
	if included(path) {
		return nil
	}
	cfg := userSSHConfig()
	if err := os.MkdirAll(filepath.Dir(cfg), 0o700); err != nil {
		return err
	}
	old, err := os.ReadFile(cfg)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	mode := os.FileMode(0o600)
	if fi, err := os.Stat(cfg); err == nil {
		mode = fi.Mode().Perm()
	}
	return atomicfile.WriteBytes(cfg, append([]byte("Include "+path+"\n\n"), old...), atomicfile.Options{Perm: mode, UID: -1})
}
