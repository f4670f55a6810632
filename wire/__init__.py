"""kvledger.wire"""
