//go:build race

package main

// raceBuild: the tests run with -race, so TestMain builds the command with it.
const raceBuild = true
