//go:build !linux

package origin

import "errors"

var errUnsupported = errors.New("origin checks need Linux procfs")

func (c Checker) socketHolders(map[uint64]struct{}) (map[uint64][]holder, error) {
	return nil, errUnsupported
}
func (c Checker) sameMountNamespace(int) (bool, error) { return false, errUnsupported }
