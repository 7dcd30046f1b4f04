package executor

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/runner/account"
)

// writeGitCredentials puts the repo credentials where git and gh look for
// them in the job user's home (runner-protocol.md 7.3) and returns a cleanup
// that removes exactly what it wrote.
func writeGitCredentials(c *api.RepoCredentials, user account.JobUser, chown bool) (func(), error) {
	noop := func() {}
	if c == nil || c.CloneURL == "" || !user.ProvisionHome {
		return noop, nil
	}
	u, err := url.Parse(c.CloneURL)
	if err != nil {
		return noop, fmt.Errorf("clone url: %w", err)
	}
	var rel string
	var data []byte
	switch u.Scheme {
	case "ssh":
		if c.PrivateKey == "" {
			return noop, errors.New("ssh clone url without a private key")
		}
		rel, data = filepath.Join(".ssh", "id_rsa"), []byte(c.PrivateKey)
	case "https":
		if c.OAuthToken == "" {
			return noop, nil
		}
		rel = filepath.Join(".config", "gh", "hosts.yml")
		data = []byte(fmt.Sprintf("%s:\n    oauth_token: %q\n", u.Hostname(), c.OAuthToken))
	default:
		return noop, fmt.Errorf("unsupported clone url scheme %q", u.Scheme)
	}
	path := filepath.Join(user.Home, rel)
	if _, err := os.Lstat(path); err == nil {
		return noop, fmt.Errorf("%s already exists", path)
	}
	uid := -1
	if chown {
		uid = user.UID
	}
	if err := homeFile(user.Home, rel, data, 0o600, uid, user.GID, false); err != nil {
		return noop, err
	}
	return func() {
		// Through the home's root: a directory swapped for a link since
		// cannot redirect the removal.
		if root, err := os.OpenRoot(user.Home); err == nil {
			_ = root.Remove(rel)
			root.Close()
		}
	}, nil
}
