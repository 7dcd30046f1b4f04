package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/ctl"
	"github.com/tandem-run/tandem/ctl/sshconfig"
)

// sshConfig is tandem's own ssh config file, which ~/.ssh/config includes
// (tandem ssh-config --install adds the Include line).
func sshConfig() (sshconfig.File, error) {
	path, err := sshconfig.DefaultPath()
	return sshconfig.File{Path: path}, err
}

// entryIdentity is the key an ssh config entry names: --identity, else
// the private key of the public one tandem run authorizes by default.
func entryIdentity(c *cli.Context) string {
	identity := c.String("identity")
	if identity == "" {
		if _, pub := ctl.DefaultPublicKey(""); pub != "" {
			identity = strings.TrimSuffix(pub, ".pub")
		}
	}
	return identity
}

// sshEndpoint is the task's endpoint for its ssh config entry, as cl's
// config reaches it (its key: entryIdentity).
func sshEndpoint(cl *ctl.Client, info api.TaskInfoResponse) (ctl.SSHEndpoint, error) {
	f, err := sshConfig()
	if err != nil {
		return ctl.SSHEndpoint{}, err
	}
	return cl.Endpoint(info, ctl.SSHOptions{PinDir: f.PinDir()})
}

// alias is the task's Host name: "tandem-" and its name with dots made
// dashes, else tandem-<short id>. The prefix and the missing dots keep it
// from ever naming a real host or an address: a task named github.com
// must not take over `ssh github.com` or `git push` of whoever includes
// the file.
func alias(info api.TaskInfoResponse) string {
	if n := ctl.TaskName(info); n != "" && ident.TaskName(n) == nil {
		return "tandem-" + strings.ReplaceAll(n, ".", "-")
	}
	return "tandem-" + ctl.ShortID(info.ID)
}

// updateSSHConfig adds (or refreshes) the task's entry, as cl reaches it.
func updateSSHConfig(cl *ctl.Client, info api.TaskInfoResponse) error {
	ep, err := sshEndpoint(cl, info)
	if err != nil {
		return err
	}
	entry, err := ctl.SSHConfigEntry(alias(info), info.ID, cl.Config().Shim, ep)
	if err != nil {
		return err
	}
	f, err := sshConfig()
	if err != nil {
		return err
	}
	return f.Put(info.ID, alias(info), entry)
}

// forgetSSHConfig drops the task's entry.
func forgetSSHConfig(taskID string) error {
	f, err := sshConfig()
	if err != nil {
		return err
	}
	return f.Forget(taskID)
}

func sshConfigCmd() *cli.Command {
	return &cli.Command{Name: "ssh-config",
		Usage:     "keep an ssh config with one Host tandem-NAME per task of yours (ssh tandem-NAME, scp, rsync, VS Code Remote)",
		ArgsUsage: "[TASK...]",
		Description: "Refreshes this shim's entries in ~/.tandem/ssh_config (TANDEM_SSH_CONFIG): the tasks you started\n" +
			"with tandem run (it adds its task's entry, and drops it when the run ends unless -d) and the TASKs\n" +
			"named here; entries of tasks that no longer run are dropped, other shims' entries stay. Other\n" +
			"tenants' tasks are never added. Each Host is tandem-<name> (dots made dashes), so no task can\n" +
			"shadow a real host. --install adds `Include ~/.tandem/ssh_config` to ~/.ssh/config once.",
		Flags: append(connFlags(), runnerSSHPortFlag,
			&cli.BoolFlag{Name: "install", Usage: "add the Include line to ~/.ssh/config"},
			&cli.BoolFlag{Name: "print", Usage: "print the file after writing it"}),
		Action: func(c *cli.Context) error {
			cfg, done, err := config(c, c.String("shim"), c.String("ssh"))
			if err != nil {
				return err
			}
			defer done()
			cfg.SSH.Identity = entryIdentity(c)
			cl, err := newClient(cfg)
			if err != nil {
				return err
			}
			infos, err := cl.Tasks(c.Context)
			if err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			f, err := sshConfig()
			if err != nil {
				return exitError{ctl.ExitFailure, "ssh config: " + err.Error()}
			}
			mine, err := f.Tasks(c.String("shim"))
			if err != nil {
				return exitError{ctl.ExitFailure, "ssh config: " + err.Error()}
			}
			for _, ref := range c.Args().Slice() {
				info, err := ctl.Match(infos, ref)
				if err != nil {
					return exitError{ctl.ExitFailure, err.Error()}
				}
				mine[info.ID] = true
			}
			var fresh []string
			for _, info := range infos {
				if info.Status != api.TaskRunning || !mine[info.ID] {
					continue
				}
				ep, err := sshEndpoint(cl, info)
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
			err = f.ReplaceShim(c.String("shim"), fresh)
			path := f.Path
			if err != nil {
				return exitError{ctl.ExitFailure, "ssh config: " + err.Error()}
			}
			fmt.Fprintf(c.App.ErrWriter, "%s: %d task(s) of %s\n", path, len(fresh), c.String("shim"))
			if c.Bool("install") {
				if err := sshconfig.Install(userSSHConfig(), path); err != nil {
					return exitError{ctl.ExitFailure, "~/.ssh/config: " + err.Error()}
				}
			} else if !sshconfig.Included(userSSHConfig(), path) {
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
