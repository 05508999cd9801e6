// Package tenant holds the one format of a tenant-scoped inbox key, shared by
// the middleware's key strategy and the operator functions that select by
// tenant.
package tenant

import (
	"errors"
	"fmt"
	"strings"
)

// Separator ends the tenant part of a scoped key. A tenant never contains
// it, so the first Separator of a key ends the tenant: "a:b" + "c" and
// "a" + "b:c" cannot meet.
const Separator = ":"

// ErrNoTenant is the error for a message without a tenant.
var ErrNoTenant = errors.New("no tenant")

// Check returns an error if t cannot be a tenant.
func Check(t string) error {
	switch {
	case t == "":
		return ErrNoTenant
	case strings.Contains(t, Separator):
		return fmt.Errorf("tenant %q contains %q, which ends the tenant part of a key", t, Separator)
	}
	return nil
}

// Key is the inbox key of key within tenant t.
func Key(t, key string) (string, error) {
	if err := Check(t); err != nil {
		return "", err
	}
	if key == "" {
		return "", errors.New("empty key")
	}
	return t + Separator + key, nil
}

// Prefix is what every key of tenant t starts with.
func Prefix(t string) string { return t + Separator }
