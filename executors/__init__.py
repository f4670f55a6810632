"""kvledger.executors"""
